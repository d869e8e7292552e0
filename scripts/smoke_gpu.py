"""``make smoke-gpu``: every command the README documents, run on a GPU at the smallest sizes that still take
the GPU path, each under a deadline, so that a command whose code changed is seen to run before a figure of it
is published.

Each case is a command, a deadline in seconds, the exit code it must end with and a regular expression a line
of its output must match (the line checked). A case that reads what another wrote (the training run's
checkpoint) runs after it (``AFTER``); the chains so formed run ``--jobs`` at a time (the tiny runs leave
the GPU mostly idle, so the whole fits in minutes). Results go to ``<out>/smoke-<gpu>.json``:
``{"gpu", "host_cpu", "commit", "date", "results": [{"name", "command", "rc", "expected_rc", "seconds",
"deadline_s", "ok", "line"}]}``; logs to ``<out>/smoke-logs/<name>.log``. Exit status 1 if any case failed.

    python scripts/smoke_gpu.py [--out docs/perf] [--only name,name] [--jobs 3] [--work /tmp/tritonllm-smoke]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

PY = sys.executable
#: the smallest training run that still exercises the graphed CUDA step, checkpoints and the sample
TINY = ["+model=void_tiny", "experiment=cpu_smoke", "trainer.batch_size=8", "trainer.seq_len=128",
        "trainer.progress=false"]

PATCH_SNIPPET = """
import torch, transformers, tritonllm
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
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

#: a tiny random Llama with a word-level tokenizer and a chat template, and chat records for data=sft (argv[1]: folder)
HF_FOLDER_SNIPPET = """
import json, sys, pathlib, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
folder = pathlib.Path(sys.argv[1]); folder.mkdir(parents=True)
specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
words = "user assistant system what is the capital of france paris germany berlin italy rome spain madrid".split()
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.add_special_tokens(specials[1:])
tok.save(str(folder / "tokenizer.json"))
template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
(folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
qa = [("what is the capital of france", "paris"), ("what is the capital of germany", "berlin"),
      ("what is the capital of italy", "rome"), ("what is the capital of spain", "madrid")]
rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in qa * 8]
(folder / "chat.jsonl").write_text("\\n".join(json.dumps(r) for r in rows) + "\\n")
print(f"hf folder: {folder}")
"""

#: our run's newest checkpoint as a Hugging Face folder, loaded by transformers: the same logits (argv: run, out;
#: a third argument: out was written by python -m tritonllm.export, only compared here)
HF_EXPORT_SNIPPET = """
import sys, torch, transformers
from tritonllm.generate import load_newest_for_generation
from tritonllm.hf import save_hf_model
_, model, _ = load_newest_for_generation(sys.argv[1], torch.device("cuda"), torch.float32)
if len(sys.argv) < 4:
    save_hf_model(model, sys.argv[2])
hf = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], torch_dtype=torch.float32).cuda()
x = torch.randint(0, model.cfg.vocab_size, (2, 32), device="cuda")
with torch.no_grad():
    ref = hf(x).logits
    err = ((ref - model(x)).abs().max() / ref.abs().max()).item()
assert err < 1e-2, err  # our fp32 GEMMs take TF32 (10-bit mantissa), transformers' full fp32
print(f"hf export: transformers logits within {err:.2e} (relative) of ours")
"""

#: the Studio server on the runs folder (argv[1]), asked for its runs through its API
STUDIO_SNIPPET = """
import json, re, subprocess, sys, time, urllib.request
proc = subprocess.Popen([sys.executable, "-m", "tritonllm.studio", sys.argv[1], "--port", "0"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
try:
    url = None
    for line in proc.stdout:
        m = re.search(r"(http://\\S+?)/\\?key=", line)
        if m:
            url = m.group(1)
            break
    runs = json.loads(urllib.request.urlopen(url + "/api/runs", timeout=30).read())
    print(f"studio: {len(runs)} runs from {url}/api/runs")
finally:
    proc.terminate()
    proc.wait(timeout=30)
"""


#: case -> the case whose output it reads (it runs after it, in the same chain)
AFTER = {"resume": "train", "generate": "resume", "generate_context": "generate", "hf_export": "generate", "studio": "hf_export",
         "dist_export": "torchrun", "generate_hf": "hf_folder", "generate_chat": "generate_hf",
         "lora_sft": "generate_chat", "export": "lora_sft", "export_check": "export"}


def chains(names: list[str]) -> list[list[str]]:
    """``names`` (in run order) as chains: each case after the one it reads (``AFTER``) where that one is among
    ``names``, else at the head of a chain of its own."""
    tail = {}
    out: list[list[str]] = []
    for name in names:
        chain = tail.get(AFTER.get(name, ""))
        if chain is None:
            chain = []
            out.append(chain)
        chain.append(name)
        tail[name] = chain
    return out


def cases(work: Path) -> list[tuple[str, list[str], int, int, str]]:
    """(name, argv, deadline s, expected rc, regex of the line checked) in run order."""
    run = work / "run"
    train = [PY, "-m", "tritonllm.train", *TINY, f"hydra.run.dir={run}"]
    hf = work / "hf_llama"
    return [
        ("train", [*train, "trainer.max_steps=20", "trainer.ckpt_interval=10"], 240, 0, r"done: validation loss"),
        ("resume", [*train, "trainer.max_steps=30", "trainer.resume=auto"], 180, 0, r"resumed from .* at step 20"),
        ("generate", [PY, "-m", "tritonllm.generate", f"ckpt={run}", "prompt='def '", "max_new_tokens=16"], 120, 0,
         r"\S"),
        ("generate_context", [PY, "-m", "tritonllm.generate", f"ckpt={run}", "prompt='def '", "max_new_tokens=16",
                              "context=4096", "rope_scaling=yarn"], 120, 0, r"\S"),
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
                            "--seq-len", "64", "--steps", "2", "--warmup", "3", "--host-profile", "2",
                            "--out", str(work / "bench")], 420, 0, r"^tritonllm"),
        ("bench_speedrun_no_model", [PY, "-m", "tritonllm.bench", "speedrun"], 120, 1, r"^tritonllm: error: no model"),
        ("bench_speedrun_refuses", [PY, "-m", "tritonllm.bench", "speedrun", "+model=void125m"], 240, 1,
         r"^tritonllm: error: .* passes, so the time to the target would measure memorisation"),
        ("bench_speedrun", [PY, "-m", "tritonllm.bench", "speedrun", "+model=void_tiny", "--max-steps", "6",
                            "--eval-every", "3", "--eval-batches", "1", "--sides", "adamw", "--allow-repeat",
                            "--out", str(work / "bench")], 300, 0, r"adamw"),
        ("patch", [PY, "-c", PATCH_SNIPPET], 180, 0, r"^patch: loss"),
        ("precision_fp8", [*train[:-1], f"hydra.run.dir={work / 'fp8'}", "trainer.precision=fp8", "trainer.max_steps=10",
                           "trainer.ckpt_interval=null"], 240, 0, r"done: validation loss"),
        ("hparams_search", [PY, "-m", "tritonllm.train", *TINY, "hparams_search=optuna", "hydra.sweeper.n_trials=2",
                            "trainer.max_steps=4", "trainer.ckpt_interval=null",
                            f"hydra.sweep.dir={work / 'optuna'}"], 300, 0, r"[Bb]est"),
        ("hf_folder", [PY, "-c", HF_FOLDER_SNIPPET, str(hf)], 120, 0, r"^hf folder"),
        ("generate_hf", [PY, "-m", "tritonllm.generate", f"hf={hf}", "prompt='what is the capital'",
                         "max_new_tokens=8"], 120, 0, r"\S"),
        ("generate_chat", [PY, "-m", "tritonllm.generate", f"hf={hf}", "chat=true", "prompt='what is the capital'",
                           "max_new_tokens=8"], 120, 0, r"\S"),
        ("lora_sft", [PY, "-m", "tritonllm.train", "+model=hf", f"model.path={hf}", "data=sft",
                      f"data.files={hf / 'chat.jsonl'}", "data.val_fraction=0.2", "+lora=default", "trainer.batch_size=4",
                      "trainer.seq_len=32", "trainer.max_steps=6", "trainer.eval_interval=3", "trainer.eval_batches=1",
                      "trainer.ckpt_interval=null", "trainer.progress=false", f"hydra.run.dir={work / 'sft'}"], 300, 0,
         r"done: validation loss"),
        ("lora_moe", [PY, "-m", "tritonllm.train", "+model=void_moe_tiny", *TINY[1:], "+lora=default",
                      "lora.targets=[q,k,v,o,gate,up,down,experts]", "trainer.max_steps=6", "trainer.ckpt_interval=null",
                      f"hydra.run.dir={work / 'lora_moe'}"], 240, 0, r"done: validation loss"),
        ("export", [PY, "-m", "tritonllm.export", f"ckpt={work / 'sft'}", f"out={work / 'sft_export'}", "dtype=fp32"],
         180, 0, r"^exported .*LoRA adapters merged"),
        ("export_check", [PY, "-c", HF_EXPORT_SNIPPET, str(work / "sft"), str(work / "sft_export"), "exported"], 180, 0,
         r"^hf export"),
        ("hf_export", [PY, "-c", HF_EXPORT_SNIPPET, str(run), str(work / "hf_export")], 180, 0, r"^hf export"),
        ("dist_export", [PY, "-m", "tritonllm.train.dist_checkpoint", "export", str(work / "torchrun" / "checkpoints"),
                         str(work / "dist_export")], 120, 0, r"\S"),
        ("evolve", [PY, "-m", "tritonllm.evolve", "+model=void_tiny", "evolve_space=tiny", "experiment=cpu_smoke",
                    "evolve.budget=64", "evolve.population=2", "evolve.generations=1",
                    f"hydra.run.dir={work / 'evolve'}"], 420, 0, r"\S"),
        ("studio", [PY, "-c", STUDIO_SNIPPET, str(work)], 120, 0, r"^studio: [1-9]"),
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
    p.add_argument("--jobs", type=int, default=3, help="chains of cases run at once (1: one case at a time)")
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
    commit = os.environ.get("TRITONLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "torch": torch.__version__,
           "commit": commit, "date": datetime.date.today().isoformat(), "results": []}
    path = out / f"smoke-{gpu_slug()}.json"
    selected = [c for c in cases(work) if not only or c[0] in only]
    by_name = {c[0]: c for c in selected}
    order = [c[0] for c in selected]
    done: dict[str, dict] = {}
    lock = threading.Lock()

    def run_chain(chain: list[str]) -> None:
        for name in chain:
            r = run_case(*by_name[name], logs)
            with lock:
                done[name] = r
                doc["results"] = [done[n] for n in order if n in done]
                print(f"{'ok  ' if r['ok'] else 'FAIL'} {name:<26} rc {r['rc']:>3} {r['seconds']:7.1f} s  "
                      f"{r['line'][:100]}", flush=True)
                path.write_text(json.dumps(doc, indent=1) + "\n")  # after every case: a run cut short keeps what ran

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(run_chain, chain) for chain in chains(order)]:
            future.result()
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    results = doc["results"]
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"wrote {path}: {len(results) - len(failed)}/{len(results)} ok in {doc['wall_s']} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
