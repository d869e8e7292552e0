"""The wheel ships kernels/ as tritonllm.kernels and conf/ as tritonllm.conf, and nothing named
`kernels` at top level (a PyPI package of that name exists)."""

import os
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
