"""Studio server and the trainer's side of it: run discovery and reading (a real void_tiny run and
fabricated folders: empty, truncated metrics, a run still being written, a dead trainer, a stale run,
an evolution search), the API, the Host and token checks, the control file the trainer polls (stop,
checkpoint now, lr multiplier on a real run in a thread), samples, end records and NVML telemetry."""

import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch
from _studio import KEY, read_records, request, serving, start_training, wait_for
from test_train import TINY, compose_train, data_overrides  # noqa: F401  (data_overrides is a fixture)

from tritonllm.checkpoint import list_checkpoints
from tritonllm.studio.hooks import GpuTelemetry, RunHooks
from tritonllm.studio.runs import Run, pareto_front, read_evolve

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, data_overrides):  # noqa: F811
    """Four steps of the tiny model with a sample every two steps; the folder as the trainer left it."""
    from tritonllm.train import train

    root = tmp_path_factory.mktemp("outputs")
    out = root / "tiny" / "2026-01-01_00-00-00"
    train(compose_train(*TINY, *data_overrides, f"out_dir={out}", "trainer.sample_tokens=4",
                        "trainer.sample_interval=2"))
    return str(root), str(out)


def _tiny_model():
    from tritonllm.models import build_model
    from tritonllm.train.loop import model_config

    cfg = compose_train(*TINY, "model.vocab_size=512")
    return build_model(model_config(cfg), device="cpu", dtype=torch.float32)


def _write(path, text, mtime=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def _lines(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def fabricated(tmp_path):
    """Run folders in every state the server must survive."""
    old = time.time() - 7200
    train = [{"kind": "train", "step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0} for s in (1, 2, 3)]
    _write(str(tmp_path / "runs" / "empty" / "x" / ".keep-out"), "")
    os.remove(tmp_path / "runs" / "empty" / "x" / ".keep-out")  # an empty leaf folder
    _write(str(tmp_path / "runs" / "truncated" / "metrics.jsonl"),
           _lines(train[0]) + '{"kind": "train", "ste\n' + _lines(train[1], {"kind": "end", "step": 2, "status": "failed",
                                                                              "error": "TrainingError: boom"})
           + '{"kind": "tra', mtime=old)
    _write(str(tmp_path / "runs" / "truncated" / "run_info.json"), "{not json")
    _write(str(tmp_path / "runs" / "truncated" / "train.log"), "x" * 10000 + "\nTrainingError: boom\n")
    _write(str(tmp_path / "runs" / "starting" / ".hydra" / "config.yaml"), "trainer: {max_steps: 10}\n")
    live = tmp_path / "runs" / "live"
    _write(str(live / "metrics.jsonl"), _lines(*train[:2]) + '{"kind": "train", "step": 3, "lo')
    _write(str(live / "studio.json"), json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    _write(str(live / "studio_token"), "live-token")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(str(tmp_path / "runs" / "dead" / "metrics.jsonl"), _lines(*train))
    _write(str(tmp_path / "runs" / "dead" / "studio.json"),
           json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    for job in ("0", "1"):  # a Hydra multirun sweep: one folder per job under the sweep's
        _write(str(tmp_path / "runs" / "multirun" / "sweep" / job / ".hydra" / "overrides.yaml"), f"- optim.lr={job}\n")
    _write(str(tmp_path / "runs" / "multirun" / "sweep" / "multirun.yaml"), "hydra: {}\n")
    _write(str(tmp_path / "runs" / "stale" / "metrics.jsonl"), _lines(*train), mtime=old)
    _write(str(tmp_path / "runs" / "stale" / "run_info.json"),
           json.dumps({"name": "stale", "config": {"trainer": {"max_steps": 100}}}), mtime=old)
    _write(str(tmp_path / "runs" / "search" / "results.csv"),  # as tritonllm.evolve writes it
           "trial,status,reason,val_loss,tokens_per_s,peak_mem_gb,pareto\n0,ok,,3.0,100.0,1.0,True\n"
           "1,ok,,2.5,80.0,1.0,True\n2,ok,,3.2,90.0,1.5,False\n3,failed,out of memory,,,,False\n")
    _write(str(tmp_path / "runs" / "search" / "best.json"), json.dumps({"memory_cap_gb": 1.2, "best": {"trial": 1}}))
    _write(str(tmp_path / "runs" / "search" / "candidates" / "0000" / "run" / "metrics.jsonl"), _lines(*train))
    _write(str(tmp_path / "runs" / "search" / ".hydra" / "config.yaml"), "evolve: {population: 3, generations: 2}\n")
    return str(tmp_path / "runs"), str(live)


# ----------------------------------------------------------------------------- reading runs

def test_real_run_is_listed_with_its_data(real_run):
    root, out = real_run
    with serving(root) as server:
        status, _, got = request(server, "GET", "/api/runs")
        assert status == 200 and not got["authorized"]
        (run,) = got["runs"]
        assert run["id"] == f"{os.path.basename(root)}/tiny/2026-01-01_00-00-00"
        assert run["status"] == "finished" and run["step"] == 4 and run["max_steps"] == 4
        assert run["checkpoints"] == 2 and run["problems"] == [] and not run["controllable"]
        status, _, detail = request(server, "GET", f"/api/run?id={run['id']}")
        assert status == 200 and "token" not in detail
        assert detail["config"]["model"]["d_model"] == 64
        params = {p["name"]: p for p in detail["params"]}
        assert sum(p["numel"] for p in params.values()) == sum(p.numel() for p in _tiny_model().parameters())
        steps = [c["step"] for c in detail["checkpoints"]]
        assert steps == [2, 4] and all(c["bytes"] > 0 and c["complete"] for c in detail["checkpoints"])
        # train() was called directly (no .hydra, argv of pytest): the resume command is not guessed
        assert detail["checkpoints"][1]["resume"] is None
        status, _, m = request(server, "GET", f"/api/metrics?id={run['id']}&since=0")
        kinds = [r["kind"] for r in m["records"]]
        assert status == 200 and m["count"] == len(kinds) == len(read_records(out))
        assert kinds.count("train") == 4 and kinds.count("val") == 2 and kinds[-1] == "end"
        assert [r["step"] for r in m["records"] if r["kind"] == "sample"] == [2, 4]  # step 4 sampled once
        _, _, tail = request(server, "GET", f"/api/metrics?id={run['id']}&since={m['count'] - 1}")
        assert tail["records"] == m["records"][-1:]


def test_checkpoint_losses_and_resume_command_from_hydra_overrides(real_run, tmp_path):
    _, out = real_run
    _write(os.path.join(out, ".hydra", "overrides.yaml"), "- +model=void_tiny\n- optim.lr=0.02\n- trainer.resume=auto\n")
    try:
        detail = Run("r", out, 600).detail(with_token=False)
    finally:
        os.remove(os.path.join(out, ".hydra", "overrides.yaml"))
    vals = {r["step"]: r["val_loss"] for r in read_records(out) if r["kind"] == "val"}
    losses = {r["step"]: r["loss"] for r in read_records(out) if r["kind"] == "train"}
    for c in detail["checkpoints"]:
        assert c["val_loss"] == vals[c["step"]] and c["loss"] == losses[c["step"]]
        assert c["resume"] == f"python -m tritonllm.train +model=void_tiny optim.lr=0.02 trainer.resume={c['path']}"
    assert detail["overrides"] == ["+model=void_tiny", "optim.lr=0.02", "trainer.resume=auto"]


def test_fabricated_runs_are_served_and_problems_named(fabricated):
    root, _ = fabricated
    with serving(root, stale_after=60) as server:
        status, _, got = request(server, "GET", "/api/runs")
        assert status == 200
        runs = {r["id"].split("/", 1)[1]: r for r in got["runs"]}
        assert set(runs) == {"empty/x", "truncated", "live", "dead", "stale", "search", "multirun/sweep/0",
                             "multirun/sweep/1", "starting", "search/candidates/0000/run"}
        assert runs["starting"]["status"] == "running" and runs["starting"]["step"] is None  # building its model
        assert runs["empty/x"]["status"] == "empty" and "nothing readable" in runs["empty/x"]["problems"][0]
        t = runs["truncated"]
        assert t["status"] == "failed" and t["step"] == 2
        problems = " | ".join(t["problems"])
        assert "1 unreadable line(s) skipped, first at line 2" in problems
        assert "last line is cut off" in problems and "run_info.json is unreadable" in problems
        assert "TrainingError: boom" in problems
        live = runs["live"]
        assert live["status"] == "running" and live["step"] == 2 and live["problems"] == []  # line 3 still being written
        assert live["controllable"]
        assert runs["dead"]["status"] == "failed" and "exited without writing its end record" in runs["dead"]["problems"][0]
        assert runs["stale"]["status"] == "stale" and runs["stale"]["name"] == "stale"
        search = runs["search"]  # 4 of 6 candidates evaluated (the failed one counts)
        assert search["evolve"] and search["status"] == "running" and search["problems"] == []
        assert (search["step"], search["max_steps"]) == (4, 6)
        for run in got["runs"]:  # every run's detail and records are served
            for path in (f"/api/run?id={run['id']}", f"/api/metrics?id={run['id']}&since=0"):
                assert request(server, "GET", path)[0] == 200, path
        _, _, search = request(server, "GET", f"/api/run?id={runs['search']['id']}")
        _, _, truncated = request(server, "GET", f"/api/run?id={runs['truncated']['id']}")
        assert truncated["log"]["file"] == "train.log" and truncated["log"]["text"].endswith("TrainingError: boom\n")
        assert len(truncated["log"]["text"]) == 8192 and truncated["config"] is None
        _, _, starting = request(server, "GET", f"/api/run?id={runs['starting']['id']}")
        assert starting["config"] == {"trainer": {"max_steps": 10}} and starting["log"] is None
        ev = search["evolve"]
        assert len(ev["rows"]) == 4 and ev["pareto"] == [0, 1] and ev["best"]["best"] == {"trial": 1}
        assert ev["rows"][3] == {"trial": 3, "status": "failed", "reason": "out of memory", "val_loss": "",
                                 "tokens_per_s": "", "peak_mem_gb": "", "pareto": "False"}
        assert request(server, "GET", "/api/run?id=nope")[0] == 404
        assert request(server, "GET", "/api/metrics?id=nope&since=0")[0] == 404


def test_cli_prints_the_address_and_serves(fabricated, tmp_path):
    root, _ = fabricated
    missing = subprocess.run([sys.executable, "-m", "tritonllm.studio", str(tmp_path / "nope")], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 1 and "not a folder" in missing.stderr
    proc = subprocess.Popen([sys.executable, "-m", "tritonllm.studio", root, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("tritonllm Studio: 10 runs under")
        address = proc.stdout.readline().split()[-1]
        assert address.startswith("http://127.0.0.1:") and "/?key=" in address
        import urllib.request

        with urllib.request.urlopen(address.split("?")[0] + "api/runs", timeout=30) as r:
            assert len(json.load(r)["runs"]) == 10
    finally:
        proc.terminate()
        proc.wait(30)


def test_live_run_grows_as_lines_are_completed(fabricated):
    root, live = fabricated
    with serving(root) as server:
        run_id = next(r["id"] for r in request(server, "GET", "/api/runs")[2]["runs"] if r["id"].endswith("/live"))
        first = request(server, "GET", f"/api/metrics?id={run_id}&since=0")[2]
        assert first["count"] == 2
        with open(os.path.join(live, "metrics.jsonl"), "a") as f:
            f.write('ss": 4.7}\n' + _lines({"kind": "train", "step": 4, "loss": 4.6}))
        more = request(server, "GET", f"/api/metrics?id={run_id}&since={first['count']}")[2]
        assert [(r["step"], r["loss"]) for r in more["records"]] == [(3, 4.7), (4, 4.6)] and more["count"] == 4


def test_pareto_front_without_a_pareto_column(tmp_path):
    rows = [{"val_loss": 2.0, "tokens_per_s": 10}, {"val_loss": 1.0, "tokens_per_s": 5},
            {"val_loss": 2.5, "tokens_per_s": 9}, {"val_loss": 1.0, "tokens_per_s": 5, "status": "failed"},
            {"tokens_per_s": 100}]
    assert pareto_front(rows) == [0, 1]
    assert pareto_front([]) == []
    assert Run("s", str(tmp_path), 600).summary()["status"] == "empty"
    _write(str(tmp_path / "results.csv"), "trial,val_loss,tokens_per_s\n0,2.0,10\n1,1.0,5\n2,2.5,9\n3,nan,100\n")
    problems = []
    ev = read_evolve(str(tmp_path), problems)
    assert ev["pareto"] == [0, 1] and ev["rows"][3]["val_loss"] is None and ev["best"] is None and problems == []
    old = time.time() - 7200
    os.utime(tmp_path / "results.csv", (old, old))
    assert Run("s", str(tmp_path), 600).summary()["status"] == "stale"  # no config: how many were due is unknown
    _write(str(tmp_path / ".hydra" / "config.yaml"), "evolve: {population: 2, generations: 2}\n")
    assert Run("s", str(tmp_path), 600).summary()["status"] == "finished"  # 4 of 4 candidates, at once


# ----------------------------------------------------------------------------- security

def test_static_files_and_host_check(fabricated):
    root, _ = fabricated
    with serving(root) as server:
        status, headers, page = request(server, "GET", "/")
        assert status == 200 and b"tritonllm Studio" in page and "default-src 'self'" in headers["Content-Security-Policy"]
        assert b"cdn" not in page.lower() and b"https://" not in page
        for name in ("studio.js", "studio.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"):
            assert request(server, "GET", f"/static/{name}")[0] == 200, name
        assert request(server, "GET", "/static/../server.py")[0] == 404
        assert request(server, "GET", "/static/%2e%2e/server.py")[0] == 404
        assert request(server, "GET", "/api/runs", headers={"Host": "attacker.example:8600"})[0] == 421
        assert request(server, "GET", "/api/runs", headers={"Host": "localhost:9999"})[0] == 200  # an SSH tunnel's port


def test_key_sets_cookie_and_only_then_the_page_gets_tokens(fabricated):
    root, _ = fabricated
    with serving(root) as server:
        assert request(server, "GET", "/?key=wrong")[0] == 403
        status, headers, _ = request(server, "GET", f"/?key={KEY}")
        assert status == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        run_id = next(r["id"] for r in request(server, "GET", "/api/runs")[2]["runs"] if r["id"].endswith("/live"))
        assert "token" not in request(server, "GET", f"/api/run?id={run_id}")[2]
        jar = {"Cookie": cookie.split(";")[0]}
        assert request(server, "GET", "/api/runs", headers=jar)[2]["authorized"]
        assert request(server, "GET", f"/api/run?id={run_id}", headers=jar)[2]["token"] == "live-token"
        assert "token" not in request(server, "GET", f"/api/run?id={run_id}", headers={"Cookie": "tritonllm_studio=x"})[2]


def test_control_refused_without_the_token(fabricated):
    root, live = fabricated
    control = os.path.join(live, "control.json")
    with serving(root) as server:
        runs = {r["id"].split("/", 1)[1]: r["id"] for r in request(server, "GET", "/api/runs")[2]["runs"]}
        path = f"/api/control?id={runs['live']}"
        assert request(server, "POST", path, {"action": "stop"})[0] == 403
        assert request(server, "POST", path, {"action": "stop"}, {"X-Studio-Token": "guess"})[0] == 403
        assert request(server, "POST", path, {"action": "stop"}, {"Cookie": f"tritonllm_studio={KEY}"})[0] == 403
        assert not os.path.exists(control)
        # a form post from another site cannot set the JSON content type
        assert request(server, "POST", path, b"action=stop", {"Content-Type": "application/x-www-form-urlencoded",
                                                              "X-Studio-Token": "live-token"})[0] == 415
        token = {"X-Studio-Token": "live-token"}
        assert request(server, "POST", path, {"action": "explode"}, token)[0] == 400
        assert request(server, "POST", path, {"action": "lr_scale", "value": 11}, token)[0] == 400
        assert request(server, "POST", path, {"action": "lr_scale", "value": 0.5}, token)[0] == 200
        assert request(server, "POST", path, {"action": "checkpoint"}, token)[0] == 200
        status, _, got = request(server, "POST", path, {"action": "stop"}, token)
        assert status == 200 and got["control"] == {"stop": True, "checkpoint": 1, "lr_scale": 0.5}
        with open(control) as f:
            assert json.load(f) == got["control"]
        assert request(server, "POST", f"/api/control?id={runs['stale']}", {"action": "stop"}, token)[0] == 404
        assert request(server, "POST", f"/api/control?id={runs['truncated']}", {"action": "stop"}, token)[0] == 404
        with open(os.path.join(root, "dead", "studio_token"), "w") as f:
            f.write("dead-token")
        assert request(server, "POST", f"/api/control?id={runs['dead']}", {"action": "stop"},
                       {"X-Studio-Token": "dead-token"})[0] == 409


# ----------------------------------------------------------------------------- the trainer's side

class _Log:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def test_hooks_poll_reads_each_request_once(tmp_path):
    run_log = _Log()
    hooks = RunHooks(str(tmp_path), run_log, torch.nn.Linear(3, 2), torch.device("cpu"))
    assert oct(os.stat(tmp_path / "studio_token").st_mode & 0o777) == "0o600"
    with open(tmp_path / "studio.json") as f:
        info = json.load(f)
    assert info["pid"] == os.getpid() and [p["name"] for p in info["params"]] == ["weight", "bias"]
    run = Run("r", str(tmp_path), 600)
    token = (tmp_path / "studio_token").read_text()
    assert hooks.poll(1) == set() and hooks.lr_scale == 1.0
    run.control(token, {"action": "lr_scale", "value": 0.25})
    assert hooks.poll(2) == set() and hooks.lr_scale == 0.25
    run.control(token, {"action": "checkpoint"})
    assert hooks.poll(3) == {"checkpoint"}
    assert hooks.poll(4) == set()  # nothing new
    run.control(token, {"action": "stop"})
    assert hooks.poll(5) == {"stop"}
    assert [(r["step"], r["action"]) for r in run_log.records] == [(2, "lr_scale"), (3, "checkpoint"), (5, "stop")]
    (tmp_path / "control.json").write_text("{broken")
    assert hooks.poll(6) == set() and hooks.lr_scale == 0.25  # a broken file is ignored (and logged)
    hooks.finish(6, "failed", ValueError("x"))
    assert run_log.records[-1]["status"] == "failed" and run_log.records[-1]["error"] == "ValueError: x"
    # a new trainer in the same folder forgets the old requests and writes a new token
    RunHooks(str(tmp_path), run_log, torch.nn.Linear(3, 2), torch.device("cpu"))
    assert not (tmp_path / "control.json").exists() and (tmp_path / "studio_token").read_text() != token


def test_every_rank_acts_on_rank_zeros_requests(tmp_path):
    """Under several processes rank 0 reads control.json and ``share`` (a broadcast) hands its
    decision to the others, which write nothing into the run folder."""
    sent = []
    rank0 = RunHooks(str(tmp_path), _Log(), torch.nn.Linear(3, 2), torch.device("cpu"),
                     share=lambda obj: sent.append(obj) or obj)
    files = sorted(os.listdir(tmp_path))
    rank1 = RunHooks(str(tmp_path), _Log(), torch.nn.Linear(3, 2), torch.device("cpu"), main=False,
                     share=lambda obj: sent[-1])
    assert sorted(os.listdir(tmp_path)) == files == ["studio.json", "studio_token"]
    token = (tmp_path / "studio_token").read_text()
    Run("r", str(tmp_path), 600).control(token, {"action": "lr_scale", "value": 2.0})
    Run("r", str(tmp_path), 600).control(token, {"action": "stop"})
    assert rank0.poll(7) == {"stop"}
    os.remove(tmp_path / "control.json")  # rank 1 learns of the requests from rank 0 alone
    assert rank1.poll(7) == {"stop"}
    assert rank0.lr_scale == rank1.lr_scale == 2.0
    assert rank1.run_log.records == [] and len(rank0.run_log.records) == 2


def test_gpu_telemetry_through_nvml(monkeypatch, caplog):
    calls = []
    fake = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(uuid) or "handle",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3e9, total=80e9),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97),
        nvmlDeviceGetTemperature=lambda h, sensor: 61, nvmlDeviceGetPowerUsage=lambda h: 612_000)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="abc-123"))
    gpu = GpuTelemetry(torch.device("cuda", 0))
    assert gpu.read() == {"gpu_mem_gb": 3.0, "gpu_mem_total_gb": 80.0, "gpu_util": 97, "gpu_temp_c": 61,
                          "gpu_power_w": 612.0}
    gpu.read()
    assert calls == ["init", "GPU-abc-123"]  # NVML started once

    def unsupported(h):
        raise RuntimeError("Not Supported")

    monkeypatch.setattr(fake, "nvmlDeviceGetPowerUsage", unsupported)
    with caplog.at_level("INFO", logger="tritonllm.studio"):
        assert set(gpu.read()) == set(gpu.read()) == {"gpu_mem_gb", "gpu_mem_total_gb", "gpu_util", "gpu_temp_c"}
    assert caplog.text.count("no power from NVML") == 1  # dropped after the first failure
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    missing = GpuTelemetry(torch.device("cuda", 0))
    with caplog.at_level("INFO", logger="tritonllm.studio"):
        assert missing.read() == {} and missing.read() == {}
    assert caplog.text.count("nvidia-ml-py is not installed") == 1
    assert RunHooks.telemetry(types.SimpleNamespace(_gpu=None)) == {}


def test_sample_interval_must_fit_the_log_interval(tmp_path):
    from tritonllm.errors import ConfigError
    from tritonllm.train import train

    with pytest.raises(ConfigError, match="sample_interval=3 .*multiple of trainer.log_interval=2"):
        train(compose_train(*TINY, "trainer.log_interval=2", "trainer.sample_interval=3", "trainer.sample_tokens=4",
                            "data.files=unread", f"out_dir={tmp_path}"))


def test_stop_request_ends_a_running_training_with_a_checkpoint(tmp_path, data_overrides):  # noqa: F811
    """lr multiplier, checkpoint now and stop sent through the server to a real run in a thread."""
    out = tmp_path / "runs" / "long"
    cfg = compose_train(*TINY, *data_overrides, f"out_dir={out}", "trainer.max_steps=200", "trainer.eval_interval=1000",
                        "trainer.ckpt_interval=null", "sched=constant", "sched.warmup_steps=0")
    thread, result = start_training(cfg)
    with serving(str(tmp_path / "runs")) as server:
        wait_for(lambda: any(r["kind"] == "train" for r in read_records(str(out))), 120, "the first train record")
        run = request(server, "GET", "/api/runs")[2]["runs"][0]
        assert run["status"] == "running" and run["controllable"]
        token = {"X-Studio-Token": (out / "studio_token").read_text()}
        path = f"/api/control?id={run['id']}"
        assert request(server, "POST", path, {"action": "stop"})[0] == 403  # no token: the run goes on
        assert request(server, "POST", path, {"action": "lr_scale", "value": 0.5}, token)[0] == 200
        assert request(server, "POST", path, {"action": "checkpoint"}, token)[0] == 200
        wait_for(lambda: list_checkpoints(str(out / "checkpoints")), 60, "checkpoint now")  # not the run.lock
        assert request(server, "POST", path, {"action": "stop"}, token)[0] == 200
        thread.join(120)
        assert not thread.is_alive()
        if "error" in result:
            raise result["error"]
        records = read_records(str(out))
        end = records[-1]
        assert end["kind"] == "end" and end["status"] == "stopped" and end["step"] < 200
        actions = [r["action"] for r in records if r["kind"] == "control"]
        assert actions == ["lr_scale", "checkpoint", "stop"]
        scaled = next(r["step"] for r in records if r.get("action") == "lr_scale")
        lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
        assert lrs[scaled] == pytest.approx(2e-2) and lrs[scaled + 1] == pytest.approx(1e-2)
        ckpts = sorted(os.listdir(out / "checkpoints"))
        assert ckpts[-1] == f"step_{end['step']:08d}" and len(ckpts) == 2
        assert request(server, "GET", "/api/runs")[2]["runs"][0]["status"] == "stopped"
        assert request(server, "POST", path, {"action": "stop"}, token)[0] == 409


@pytest.mark.gpu
def test_gpu_run_logs_nvml_telemetry_and_samples_do_not_change_training(tmp_path, data_overrides):  # noqa: F811
    """On a CUDA device: NVML figures in every train record; a run that samples mid-training (the decode
    graph captured beside the training step's graph) has the same losses as one that does not."""
    from tritonllm.train import train

    common = [*TINY, *data_overrides, "device=cuda", "trainer.max_steps=8", "trainer.eval_interval=4",
              "trainer.ckpt_interval=null", "trainer.sample_tokens=8"]
    train(compose_train(*common, f"out_dir={tmp_path / 'plain'}"))
    train(compose_train(*common, f"out_dir={tmp_path / 'sampled'}", "trainer.sample_interval=2"))
    plain, sampled = read_records(str(tmp_path / "plain")), read_records(str(tmp_path / "sampled"))
    losses = [[(r["step"], r["loss"]) for r in recs if r["kind"] == "train"] for recs in (plain, sampled)]
    assert losses[0] == losses[1] and len(losses[0]) == 8
    assert [r["step"] for r in sampled if r["kind"] == "sample"] == [2, 4, 6, 8]
    for r in (r for r in plain if r["kind"] == "train"):
        assert 0 < r["gpu_mem_gb"] <= r["gpu_mem_total_gb"] and 0 <= r["gpu_util"] <= 100
        assert 0 < r["gpu_temp_c"] < 120 and r["gpu_power_w"] > 0
