"""``make smoke-gpu``: every command the README documents, run on a GPU at the smallest sizes that still take
the GPU path, each under a deadline, so that a command whose code changed is seen to run before a figure of it
is published.

Each case is a command, a deadline in seconds, the exit code it must end with and a regular expression a line
of its output must match (the line checked). The cases run in order (later ones read what earlier ones
wrote: the checkpoint of the training run). Results go to ``<out>/smoke-<gpu>.json``:
``{"gpu", "host_cpu", "commit", "date", "results": [{"name", "command", "rc", "expected_rc", "seconds",
"deadline_s", "ok", "line"}]}``; logs to ``<out>/smoke-logs/<name>.log``. Exit status 1 if any case failed.

    python scripts/smoke_gpu.py [--out docs/perf] [--only name,name] [--work /tmp/tritonllm-smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
#: the smallest training run that still exercises the graphed CUDA step, checkpoints and the sample
TINY = ["+model=void_tiny", "experiment=cpu_smoke", "trainer.batch_size=8", "trainer.seq_len=128",
        "trainer.progress=false"]

PATCH_SNIPPET = """
import torch, transformers, tritonllm
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
ref = transformers.LlamaForCausalLM(cfg).cuda()
model = transformers.LlamaForCausalLM(cfg).cuda()
model.load_state_dict(ref.state_dict())
tritonllm.patch(model)
x = torch.randint(0, 128, (2, 64), device="cuda")
a, b = ref(x, labels=x).loss, model(x, labels=x).loss
b.backward()
err = abs(a.item() - b.item())
assert err < 1e-3, err
print(f"patch: loss {b.item():.5f} vs transformers {a.item():.5f} (diff {err:.2e})")
"""


def cases(work: Path) -> list[tuple[str, list[str], int, int, str]]:
    """(name, argv, deadline s, expected rc, regex of the line checked) in run order."""
    run = work / "run"
    train = [PY, "-m", "tritonllm.train", *TINY, f"hydra.run.dir={run}"]
    return [
        ("train", [*train, "trainer.max_steps=20", "trainer.ckpt_interval=10"], 240, 0, r"done: validation loss"),
        ("resume", [*train, "trainer.max_steps=30", "trainer.resume=auto"], 180, 0, r"resumed from .* at step 20"),
        ("generate", [PY, "-m", "tritonllm.generate", f"ckpt={run}", "prompt='def '", "max_new_tokens=16"], 120, 0,
         r"\S"),
        ("multirun", [PY, "-m", "tritonllm.train", "-m", *TINY, "trainer.max_steps=4", "trainer.ckpt_interval=null",
                      "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={work / 'multirun'}"], 240, 0, r"#1 :"),
        ("torchrun", ["torchrun", "--nproc_per_node=1", "-m", "tritonllm.train", *TINY, "trainer.max_steps=4",
                      "trainer.ckpt_interval=null", f"hydra.run.dir={work / 'torchrun'}"], 240, 0, r"done: validation loss"),
        ("bench_kernels", [PY, "-m", "tritonllm.bench", "kernels", "--ops", "rms_norm", "--sizes", "default",
                           "--out", str(work / "bench")], 240, 0, r"rms_norm"),
        ("bench_train", [PY, "-m", "tritonllm.bench", "train", "+model=void_tiny", "--steps", "3", "--warmup", "3",
                         "--baselines", "compile", "--host-profile", "2", "--out", str(work / "bench")], 300, 0,
         r"tokens/s|speedup"),
        ("bench_decode", [PY, "-m", "tritonllm.bench", "decode", "+model=void_tiny", "--batch", "1",
                          "--prompt-len", "16", "--new-tokens", "8", "--out", str(work / "bench")], 240, 0,
         r"tok|ms"),
        ("bench_finetune", [PY, "-m", "tritonllm.bench", "finetune", "--config", "tiny", "--batch", "2",
                            "--seq-len", "128", "--steps", "2", "--warmup", "3", "--host-profile", "2",
                            "--out", str(work / "bench")], 420, 0, r"^tritonllm"),
        ("bench_speedrun_no_model", [PY, "-m", "tritonllm.bench", "speedrun"], 120, 1, r"^tritonllm: error: no model"),
        ("bench_speedrun", [PY, "-m", "tritonllm.bench", "speedrun", "+model=void_tiny", "--max-steps", "6",
                            "--eval-every", "3", "--eval-batches", "1", "--sides", "adamw", "--allow-repeat",
                            "--out", str(work / "bench")], 300, 0, r"adamw"),
        ("patch", [PY, "-c", PATCH_SNIPPET], 180, 0, r"^patch: loss"),
    ]


def run_case(name: str, argv: list[str], deadline: int, expected: int, pattern: str, logs: Path) -> dict:
    started = time.perf_counter()
    log = logs / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    seconds = time.perf_counter() - started
    text = log.read_text(errors="replace").splitlines()
    line = next((s for s in text if re.search(pattern, s)), None)
    ok = rc == expected and line is not None and (expected != 0 or not any("Traceback" in s for s in text))
    return {"name": name, "command": shlex.join(argv).replace(PY, "python"), "rc": rc, "expected_rc": expected,
            "seconds": round(seconds, 1), "deadline_s": deadline, "ok": ok,
            "line": (line or (text[-1] if text else ""))[:300]}


def main() -> int:
    p = argparse.ArgumentParser(prog="python scripts/smoke_gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/perf", help="folder for smoke-<gpu>.json and smoke-logs/")
    p.add_argument("--work", default="/tmp/tritonllm-smoke", help="scratch folder for runs and checkpoints")
    p.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("scripts/smoke_gpu.py needs a CUDA GPU")
    from tritonllm.bench.common import host_cpu_model
    from tritonllm.bench.harness import gpu_slug

    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    logs = out / "smoke-logs"
    logs.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    results = []
    for name, argv, deadline, expected, pattern in cases(work):
        if only and name not in only:
            continue
        r = run_case(name, argv, deadline, expected, pattern, logs)
        results.append(r)
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {name:<26} rc {r['rc']:>3} {r['seconds']:7.1f} s  {r['line'][:100]}",
              flush=True)
    commit = os.environ.get("TRITONLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "torch": torch.__version__,
           "commit": commit, "date": datetime.date.today().isoformat(), "results": results}
    path = out / f"smoke-{gpu_slug()}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"wrote {path}: {len(results) - len(failed)}/{len(results)} ok" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
