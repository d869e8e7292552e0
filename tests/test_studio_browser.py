"""Studio in a real headless Chromium driven by Playwright: the page loads without console errors,
lists the runs, a chart grows while a real void_tiny run (in a thread) appends metrics, the
lr multiplier reaches the trainer, the stop button ends that run with a checkpoint, and an evolution search's front is shown. A screenshot goes to the test's folder
(``TRITONLLM_STUDIO_SCREENSHOT=docs/studio.png`` writes it there as well).

Needs Chromium (Debian: ``apt-get install chromium``; or set ``TRITONLLM_CHROMIUM`` to a Chrome or
Chromium binary) and Playwright (``pip install -e .[test]``); ``.ci/run`` installs Chromium. Without
them these tests are skipped with a message saying so.
"""

import os
import shutil
import warnings

import pytest
from _studio import KEY, read_records, serving, start_training, wait_for
from test_train import TINY, compose_train, data_overrides  # noqa: F401  (data_overrides is a fixture)

CHROMIUM = os.environ.get("TRITONLLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# flags for a machine without network or display: no background connections, no GPU, no sandbox as root
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

MISSING = ("Playwright (pip install -e '.[test]')" if sync_playwright is None else
           "Chromium (apt-get install chromium on Debian, or TRITONLLM_CHROMIUM=<chrome binary>; .ci/run installs it)"
           if CHROMIUM is None else None)
if MISSING:  # a warning, so that `make test` (pytest -q) says in its summary why and how to enable them
    warnings.warn(f"Studio browser tests skipped: they need {MISSING}", UserWarning, stacklevel=1)
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"Studio browser tests need {MISSING}")


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page that records console errors and uncaught exceptions in ``page.errors``."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.errors = []
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    yield pg
    context.close()


def _points(page, chart: str) -> int:
    return int(page.get_attribute(f'[data-chart="{chart}"]', "data-points") or 0)


def test_page_follows_a_live_run_and_stops_it(page, tmp_path, data_overrides):  # noqa: F811
    root = tmp_path / "outputs"
    finished = root / "void_tiny" / "earlier"
    start_training(compose_train(*TINY, *data_overrides, f"out_dir={finished}"))[0].join(300)
    live = root / "void_tiny" / "live"
    cfg = compose_train(*TINY, *data_overrides, f"out_dir={live}", "trainer.max_steps=300", "trainer.eval_interval=4",
                        "trainer.ckpt_interval=null", "trainer.sample_tokens=6", "trainer.sample_interval=4")
    thread, result = start_training(cfg)
    try:
        with serving(str(root)) as server:
            wait_for(lambda: read_records(str(live)), 120, "the live run's first record")
            page.goto(f"{server.url}?key={KEY}")  # the printed address: sets the cookie, redirects to /
            assert page.url == server.url
            page.wait_for_selector('#runs tr[data-status="finished"]')
            page.locator("#runs tbody tr", has_text="live").click()
            page.wait_for_selector('[data-chart="loss"]')
            first = wait_for(lambda: _points(page, "loss"), 30, "points on the loss chart")
            wait_for(lambda: _points(page, "loss") >= first + 2, 60, "the loss chart to grow")
            for chart in ("lr", "tokens_per_s", "grad_norm"):
                assert _points(page, chart) > 0, chart
            page.locator("#runs tbody tr", has_text="earlier").locator("input[type=checkbox]").check()
            wait_for(lambda: "void_tiny/earlier" in (page.text_content('[data-chart="loss"]') or ""), 10,
                     "the finished run overlaid on the loss chart")
            page.wait_for_selector("#samples pre")
            page.wait_for_function("() => !document.getElementById('btn-stop').disabled")
            page.fill("#lr-scale", "0.5")
            page.click("#btn-lr")
            wait_for(lambda: any(r.get("action") == "lr_scale" and r["lr_scale"] == 0.5 for r in read_records(str(live))),
                     60, "the trainer to take the new lr multiplier")
            page.click("#btn-stop")
            assert page.text_content("#btn-stop") == "Click again to stop"
            page.click("#btn-stop")
            page.wait_for_selector('#runs tr[data-status="stopped"]', timeout=120_000)
            thread.join(60)
            page.wait_for_function("() => document.querySelectorAll('#checkpoints code.cmd').length > 0"
                                   " || document.querySelector('#checkpoints td') !== null")
            shot = tmp_path / "studio.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("TRITONLLM_STUDIO_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["TRITONLLM_STUDIO_SCREENSHOT"])
            # an evolution search's folder: its candidates, the front highlighted and plotted
            (root / "search").mkdir()
            (root / "search" / "results.csv").write_text(
                "trial,status,val_loss,tokens_per_s,peak_mem_gb,pareto\n0,ok,3.0,100,1.0,True\n1,ok,2.5,80,1.0,True\n"
                "2,ok,3.2,90,1.5,False\n3,failed,,,,False\n")
            page.locator("#runs tbody tr", has_text="search").click()
            page.wait_for_selector('#evolve-box:not([hidden]) [data-chart="pareto"] canvas')
            assert page.locator("#evolve tr.pareto").count() == 2
    finally:
        if thread.is_alive():  # the page failed to stop it: stop it through the control file
            (live / "control.json").write_text('{"stop": true}')
            thread.join(120)
    if "error" in result:
        raise result["error"]
    records = read_records(str(live))
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "stopped"
    assert os.listdir(live / "checkpoints") == [f"step_{records[-1]['step']:08d}"]
    assert page.errors == []
