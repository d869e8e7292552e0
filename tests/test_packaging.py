"""The wheel ships kernels/ as tritonllm.kernels and conf/ as tritonllm.conf, and nothing named
`kernels` at top level (a PyPI package of that name exists); the bench package has no import cycle;
each make target installs what it needs."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), ROOT], check=True, capture_output=True)
    (whl,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    with zipfile.ZipFile(out / whl) as z:
        return z.namelist()


def test_wheel_maps_kernels_and_conf_into_tritonllm(wheel_names):
    assert "tritonllm/kernels/__init__.py" in wheel_names
    assert "tritonllm/conf/train.yaml" in wheel_names
    assert any(n.startswith("tritonllm/conf/model/") and n.endswith(".yaml") for n in wheel_names)


def test_wheel_installs_nothing_named_kernels_at_top_level(wheel_names):
    tops = {n.split("/")[0] for n in wheel_names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"tritonllm"}, tops


def test_every_kernel_module_is_in_the_wheel(wheel_names):
    for f in os.listdir(os.path.join(ROOT, "kernels")):
        if f.endswith(".py"):
            assert f"tritonllm/kernels/{f}" in wheel_names, f


def test_wheel_ships_the_studio_page_and_its_vendored_charts(wheel_names):
    for f in ("index.html", "studio.js", "studio.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css",
              "vendor/uPlot.LICENSE"):
        assert f"tritonllm/studio/static/{f}" in wheel_names, f


def _bench_imports() -> dict[str, set[str]]:
    """tritonllm.bench's modules -> the modules of tritonllm.bench each imports (at the top or inside a function)."""
    import ast

    folder = os.path.join(ROOT, "tritonllm", "bench")
    modules = {f"tritonllm.bench.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py")}
    graph: dict[str, set[str]] = {}
    for module in modules:
        tree = ast.parse(open(os.path.join(folder, module.rpartition(".")[2] + ".py")).read())
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        graph[module] = (names & modules) - {module}
    return graph


def test_bench_package_has_no_import_cycle():
    """The bench modules import one another one way only (their shared utilities live in bench/common.py):
    a depth-first search finds no module that leads back to itself."""
    graph = _bench_imports()
    assert "tritonllm.bench.common" in graph["tritonllm.bench.train"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_each_make_target_installs_what_it_needs(tmp_path):
    """From a clean checkout (no virtual environment yet) each target creates it and installs its own extras:
    `make train` only tritonllm and its dependencies; the test, lint and sweep extras go with their targets."""
    def plan(target: str) -> str:
        return subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout

    extras = {"train": [], "test": ['".[test,sweep]"'], "lint": ['".[lint]"'],
              "typecheck": ['".[lint]"', '".[test,sweep]"']}
    for target, wanted in extras.items():
        commands = plan(target)
        assert "-m venv" in commands and "pip install -q -e .\n" in commands, (target, commands)
        assert sorted(re.findall(r'"\.\[[a-z,]+\]"', commands)) == sorted(wanted), (target, commands)
