"""``python -m tritonllm.bench finetune [--config tinyllama] [--batch 4 --seq-len 2048 --rank 16] [--sides ...]``

LoRA fine-tuning throughput of one model of a published shape (``--config``: TinyLlama-1.1B, Llama-3.1-8B,
Qwen3-8B, and the Mixture-of-Experts Qwen3-30B-A3B and OLMoE-1B-7B; ``--layers N`` keeps the first N
layers, for a shape whose folder or memory would not fit), randomly initialised by ``transformers`` in this
process (no download) and saved to a temporary Hugging Face folder,
trained the same way by each side, one after the other in the same process (GPU memory freed
between them), on the same random batch:

- ``tritonllm``: the folder imported by :func:`tritonllm.hf.load_hf_model` in ``--dtype``, LoRA
  by :func:`tritonllm.nn.lora.apply_lora`, tritonllm's AdamW (fp32 master copies of the adapters),
  one optimizer step = :class:`tritonllm.train.step.TrainStep` with a CUDA graph (the headline;
  ``cuda_graph`` says whether the capture held) and eagerly (the ``eager`` entry).
- ``peft``: ``transformers.AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa")``
  in ``--dtype`` with ``peft.get_peft_model`` (PEFT's defaults: fp32 adapters), eager.
- ``peft+compile``: the same PEFT model under ``torch.compile`` (default mode).
- ``liger+peft``: Liger-Kernel's ``apply_liger_kernel_to_llama`` / ``_qwen3(model=...)`` (RMSNorm, SwiGLU,
  RoPE, fused linear cross-entropy) then PEFT, when ``liger_kernel`` is importable.
- ``patch+peft``: :func:`tritonllm.patch` on the transformers model, then PEFT.

LoRA everywhere: rank ``--rank``, alpha 2 x rank, no dropout, on q, k, v, o, gate, up, down (a MoE
model: q, k, v, o and the routed experts' fused gate/up and down weights, PEFT's ``target_parameters``;
``patch+peft`` is not run there: the patched MoE block reads the expert weights, which PEFT's parameter
adapters wrap); the base frozen. The transformers sides step ``loss = model(input_ids, labels=labels).loss``,
``loss.backward()``, ``clip_grad_norm_(adapters, 1.0, foreach=True)``,
``torch.optim.AdamW(adapters, fused=True)``, ``zero_grad(set_to_none=True)``; tritonllm's step does
the same with its kernels. Labels: random tokens, the first quarter of each row -100 (a prompt).
``--activation-checkpointing full``: every side recomputes each decoder layer in the backward
(tritonllm's ``trainer.activation_checkpointing=full``; transformers' ``gradient_checkpointing_enable``,
non-reentrant), for the longest sequences; the row names the setting. ``--precision fp8``: tritonllm's
frozen base layers run their GEMMs on fp8 operands (``trainer.precision=fp8``: the adapters stay bf16), the
transformers sides as they are (bf16); the row names it.

Figures per side (the GPU timing of ``tritonllm.bench.train``, :func:`tritonllm.bench.common.measure`):
``step_ms`` (wall), ``tokens_per_s`` (B T / step), ``gpu_ms`` (profiler kernel sum), ``host_ms``,
``peak_mem_gb``, ``triton_share`` (GPU time in tritonllm's kernels), ``mfu`` with the FLOPs of a
frozen-base LoRA step, ``4 N + 12 n_layers n_heads head_dim T`` per token (no weight gradients for
the base; N the parameters a token passes through: a MoE model's active ones). ``speedup`` = the fastest transformers baseline's ``step_ms`` / tritonllm's;
``patch_speedup`` the same for ``patch+peft``. One row goes to ``docs/perf/train-<gpu>.json``
(:func:`tritonllm.bench.harness.write_results`), rewritten after every side.

Without a GPU the sides run on the CPU (through Triton's interpreter; use ``--config tiny
--dtype fp32``): a smoke run of the code path, wall time only, nothing written.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch

from tritonllm.bench.common import free_gpu
from tritonllm.runtime import ArgumentParser, exit_on_user_error

#: model shapes (the family's transformers config fields), as published: TinyLlama-1.1B, Llama-3.1-8B (its
#: llama3 RoPE scaling), Qwen3-8B (QK-norm, head_dim 128); tiny for the CPU
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tinyllama": ("llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3_8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "qwen3_8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen3_30b_a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                        rope_theta=1000000.0, tie_word_embeddings=False)),
    "olmoe_1b_7b": ("olmoe", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                  norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                  rope_theta=10000.0, tie_word_embeddings=False)),
    "tiny": ("llama", dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                           tie_word_embeddings=False)),
    "tiny_moe": ("qwen3_moe", dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                   max_position_embeddings=64, tie_word_embeddings=False)),
}
#: family -> (transformers config class, model class, Liger-Kernel's patch function)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "apply_liger_kernel_to_qwen3_moe"),
            "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "apply_liger_kernel_to_olmoe")}
AC = ("none", "full")
SIDES = ("tritonllm", "peft", "peft+compile", "liger+peft", "patch+peft")
BASELINES = ("peft", "peft+compile", "liger+peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: a MoE model's: attention's projections, and the routed experts' fused parameters (PEFT's target_parameters)
MOE_TARGETS, EXPERT_PARAMETERS = TARGETS[:4], ["experts.gate_up_proj", "experts.down_proj"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LR = 1e-4
PEAK_FLOPS = 989e12  # H100/H200 dense bf16, as trainer.peak_flops


def _parse(argv: list[str]):
    p = ArgumentParser(prog="python -m tritonllm.bench finetune", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", default="tinyllama", choices=sorted(CONFIGS), help="model shape")
    p.add_argument("--layers", type=int, default=0, help="keep the config's first N layers (0: all)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--activation-checkpointing", default="none", choices=AC,
                   help="every side recomputes each decoder layer in the backward (full)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="tritonllm's base layers: bf16, or fp8 GEMMs (trainer.precision)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 3 on a GPU: tritonllm's graph capture)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/perf", help="folder for train-<gpu>.json")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also profile the host over this many steps per side (top functions in the JSON row)")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if args.warmup < (3 if torch.cuda.is_available() else 1) or args.steps < 1:
        p.error(f"--warmup must be >= 3 (>= 1 on the CPU) and --steps >= 1, got {args.warmup} and {args.steps}")
    for name in ("batch", "seq_len", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.layers <= CONFIGS[args.config][1]["num_hidden_layers"]:
        p.error(f"--layers must be in [0, {CONFIGS[args.config][1]['num_hidden_layers']}] for {args.config}, "
                f"got {args.layers}")
    if args.host_profile < 0:
        p.error(f"--host-profile must be >= 0 (0: no profile), got {args.host_profile}")
    if args.seq_len > CONFIGS[args.config][1]["max_position_embeddings"]:
        p.error(f"--seq-len {args.seq_len} exceeds the {args.config} config's max_position_embeddings")
    return args


def is_moe(config: str) -> bool:
    """Whether the ``--config`` shape has routed experts."""
    return "num_experts" in CONFIGS[config][1]


def lora_flops_per_token(hf_config, n_params: int, T: int) -> int:
    """FLOPs per token of a LoRA step on a frozen base: forward 2N and input gradients 2N, plus
    attention ``12 n_layers n_heads head_dim T`` (forward and backward, as tritonllm's count)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 4 * n_params + 12 * hf_config.num_hidden_layers * hf_config.num_attention_heads * head_dim * T


def _measure(step, args, tokens: int, flops_per_token: int, cycles_per_ms: float | None):
    """The side's figures: :func:`tritonllm.bench.common.measure`, with the share of tritonllm's kernels on CUDA
    (``cycles_per_ms`` None: on the CPU, wall time only)."""
    from tritonllm.bench.common import measure

    figures, ours, others = measure(step, args, tokens, flops_per_token, PEAK_FLOPS, cycles_per_ms)
    if cycles_per_ms is None:
        return figures
    total = sum(ours.values()) + sum(others.values())
    figures["triton_share"] = round(sum(ours.values()) / total, 4) if total else None
    figures["top_other_kernels_ms"] = {k: round(v, 3) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:8]}
    return figures


HEADER = f"{'side':<26}{'tokens/s':>12}{'step ms':>10}{'GPU ms':>10}{'host ms':>10}{'peak GB':>9}{'triton':>8}"


def _line(name: str, f: dict) -> str:
    """One side's figures (``-`` where not measured: on the CPU only the wall time is)."""
    if "error" in f:
        return f"{name:<26}failed: {f['error']}"

    def cell(key, width, fmt):
        return f"{format(f[key], fmt) if f.get(key) is not None else '-':>{width}}"
    return (f"{name:<26}{cell('tokens_per_s', 12, ',')}{cell('step_ms', 10, '.2f')}{cell('gpu_ms', 10, '.2f')}"
            f"{cell('host_ms', 10, '.2f')}{cell('peak_mem_gb', 9, '.2f')}{cell('triton_share', 8, '.1%')}")


def _hf_step(model, params):
    """One transformers optimizer step on ``model`` (a PEFT model, possibly compiled)."""
    optimizer = torch.optim.AdamW(params, lr=LR, fused=params[0].is_cuda)

    def run(x, labels):
        loss = model(input_ids=x, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def _peft_model(folder: str, side: str, args, device):
    """The transformers model of ``folder`` prepared for ``side``, with PEFT LoRA adapters."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype],
                                                              attn_implementation="sdpa").to(device)
    if side == "liger+peft":
        import liger_kernel.transformers

        getattr(liger_kernel.transformers, FAMILIES[CONFIGS[args.config][0]][2])(model=model)
    elif side == "patch+peft":
        from tritonllm.patch import patch

        patch(model)
    if args.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe = is_moe(args.config)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=MOE_TARGETS if moe else TARGETS,
                             target_parameters=EXPERT_PARAMETERS if moe else None)
    return peft.get_peft_model(model, config).train()


def time_hf(side: str, folder: str, x, labels, args, flops_per_token, cycles_per_ms) -> dict:
    if side == "patch+peft" and is_moe(args.config):
        return {"error": "not run on a MoE model: the patched MoE block reads the expert weights that PEFT's "
                         "target_parameters adapters wrap, so their updates would be left out"}
    model = _peft_model(folder, side, args, x.device)
    params = [p for p in model.parameters() if p.requires_grad]
    run = _hf_step(torch.compile(model) if side == "peft+compile" else model, params)
    try:
        return _measure(lambda: run(x, labels), args, x.numel(), flops_per_token, cycles_per_ms)
    finally:
        del run, model, params
        torch._dynamo.reset()
        if x.is_cuda:
            free_gpu()


def time_tritonllm(folder: str, x, labels, args, flops_per_token, cycles_per_ms) -> tuple[dict, bool]:
    """tritonllm's graphed step (eager on the CPU) with its eager figures under ``eager``; whether
    the graph was captured."""
    from tritonllm.hf import load_hf_model
    from tritonllm.nn.lora import EXPERTS, TARGETS as LORA_TARGETS, LoRAConfig, apply_lora
    from tritonllm.optim import AdamW
    from tritonllm.train.step import TrainStep

    from tritonllm.nn.fp8 import apply_precision
    from tritonllm.nn.recompute import apply_activation_checkpointing

    model = load_hf_model(folder, device=x.device, dtype=DTYPES[args.dtype])
    targets = [*LORA_TARGETS[:4], EXPERTS] if is_moe(args.config) else list(LORA_TARGETS)
    apply_lora(model, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=targets))
    apply_precision(model, args.precision)
    apply_activation_checkpointing(model, args.activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(params, lr=LR, weight_decay=0.0, master_weights=DTYPES[args.dtype] != torch.float32)
    # tritonllm's loss at position t is against targets[t]: the labels shifted by one, as transformers shifts them
    y = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    figures, captured = {}, False
    for graph in ((False, True) if x.is_cuda else (False,)):
        step = TrainStep(model, optimizer, grad_clip=1.0, cuda_graph=graph)
        figures[graph] = _measure(lambda: step([(x, y)], lr=LR), args, x.numel(), flops_per_token, cycles_per_ms)
        captured = captured or step.graphed
        del step
        if x.is_cuda:
            free_gpu()
    del model, optimizer, params
    if not x.is_cuda:
        return figures[False], False
    return {**figures[True], "eager": figures[False]}, captured


def _speedup(row: dict, side: dict) -> float | None:
    timed = [b["step_ms"] for name, b in row["baselines"].items() if name in BASELINES and "step_ms" in b]
    return round(min(timed) / side["step_ms"], 3) if timed and "step_ms" in side else None


def main(argv: list[str]) -> dict:
    import transformers

    from tritonllm.bench.common import host_cpu_model, spin_cycles_per_ms
    from tritonllm.bench.harness import liger_available, write_results

    args = _parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    host_cpu = host_cpu_model()
    cycles_per_ms = spin_cycles_per_ms() if device.type == "cuda" else None
    torch.manual_seed(args.seed)
    family, fields = CONFIGS[args.config]
    config_class, model_class, _ = FAMILIES[family]
    hf_config = getattr(transformers, config_class)(**{**fields, **(
        {"num_hidden_layers": args.layers} if args.layers else {})})
    with torch.device(device):
        model = getattr(transformers, model_class)(hf_config)
    n_params = model.num_parameters()
    active = n_params
    if is_moe(args.config):
        from tritonllm.hf import config_from_hf

        ours = config_from_hf(hf_config.to_dict(), max_seq_len=args.seq_len)
        active = n_params - ours.param_count() + ours.param_count(active=True)
    flops_per_token = lora_flops_per_token(hf_config, active, args.seq_len)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    B, T = args.batch, args.seq_len
    x = torch.randint(0, hf_config.vocab_size, (B, T), device=device, generator=gen)
    labels = x.clone()
    labels[:, : T // 4] = -100
    name = (f"{args.config}" + (f" ({args.layers} layers)" if args.layers else "") + f" LoRA r{args.rank}"
            + (" AC full" if args.activation_checkpointing == "full" else "")
            + (" tritonllm fp8" if args.precision == "fp8" else ""))
    print(f"{name}: {n_params / 1e6:.1f}M parameters ({active / 1e6:.1f}M active), B{B} x T{T} {args.dtype} on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, host CPU: {host_cpu}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    row = {"op": "finetune", "model": name, "batch": B, "seq_len": T, "dtype": args.dtype, "lora_rank": args.rank,
           "lora_targets": MOE_TARGETS + EXPERT_PARAMETERS if is_moe(args.config) else TARGETS,
           "activation_checkpointing": args.activation_checkpointing, "precision": args.precision, "nproc": 1,
           "parallel": "none", "baselines": {}, "speedup": None, "host_cpu": host_cpu}
    print(HEADER)
    named = _device_named()
    with tempfile.TemporaryDirectory() as folder:
        model.to(DTYPES[args.dtype]).save_pretrained(folder)
        del model
        for side in args.sides:
            try:
                if side == "tritonllm":
                    figures, row["cuda_graph"] = time_tritonllm(folder, x, labels, args, flops_per_token,
                                                                cycles_per_ms)
                    row.update(figures)
                elif side == "liger+peft" and not liger_available():
                    figures = {"error": "liger_kernel is not importable"}
                else:
                    figures = time_hf(side, folder, x, labels, args, flops_per_token, cycles_per_ms)
            except Exception as e:  # a side that fails is reported, not fatal
                figures = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if side == "tritonllm":
                    row["error"] = figures["error"]
            if side == "patch+peft":
                row["patch"] = figures
            elif side != "tritonllm":
                row["baselines"][side] = figures
            print(_line(side if side != "tritonllm" or device.type != "cuda" else "tritonllm (CUDA graph)", figures),
                  flush=True)
            if side == "tritonllm" and "eager" in figures:
                print(_line("tritonllm (eager)", figures["eager"]), flush=True)
            row["speedup"] = _speedup(row, row)
            if "patch" in row:
                row["patch_speedup"] = _speedup(row, row["patch"])
            if named:
                path = write_results("train", [row], args.out, extra={"host_cpu": host_cpu})
    if row["speedup"] is not None:
        print(f"tritonllm: {row['speedup']:.3f}x the fastest transformers baseline's tokens/s")
    if row.get("patch_speedup") is not None:
        print(f"tritonllm.patch + PEFT: {row['patch_speedup']:.3f}x")
    print(f"wrote {os.path.abspath(path)}" if named else "not written: no GPU to name train-<gpu>.json after")
    return row


def _device_named() -> bool:
    """Whether write_results can name the results file after the GPU."""
    try:
        torch.cuda.get_device_name()
    except (AssertionError, RuntimeError):
        return False
    return True


if __name__ == "__main__":
    exit_on_user_error(main)(sys.argv[1:])
