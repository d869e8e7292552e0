"""``python -m tritonllm.bench decode +model=void125m [--batch 1,32 --prompt-len 128 --new-tokens 256 --out docs/perf]``

Decode throughput of ``Transformer.generate`` against a plain-PyTorch model of the same
architecture, in one process run, with random weights (the weights do not change the speed) and
random prompts. The model config is composed like ``python -m tritonllm.train``'s (Hydra
overrides after the options). Greedy decoding on every side, so the sides do the same work.

Sides, per batch size B:

- **tritonllm graphed**: ``model.generate(..., cuda_graph=True)`` in bf16: the prompt prefilled
  eagerly into the static KV cache, then one decode step (every layer, the LM head and the
  sampling, positions read from device memory) captured as a CUDA graph and replayed per token.
- **tritonllm eager**: the same, ``cuda_graph=False``: the same kernels launched from Python per token.
- **torch eager**: :class:`StaticCacheLlama` below, what a PyTorch expert writes for fast decoding
  (the gpt-fast recipe): bf16 weights loaded from the tritonllm model, a static KV cache
  ``[B, Hkv, max_len, D]`` per layer written in place with ``index_copy_`` at a position tensor,
  SDPA over the whole cache with a boolean mask of the filled positions (``enable_gqa``),
  ``F.rms_norm``, RoPE tables built once, SwiGLU over the packed gate/up weight, argmax in the step;
  no allocation that grows with the position.
- **reduce-overhead**: that decode step (model + argmax) under
  ``torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False)`` (CUDA graphs through
  Inductor; SDPA's math backend in the step, as gpt-fast does, so Inductor fuses the attention of
  one query); the prefill stays eager.
- **reduce-overhead-sdpa** (opt-in with ``--baselines``): the same with SDPA's own backend choice
  (fused memory-efficient kernel for the masked query), which may win at large batch, where the
  math backend's GQA path expands the cached keys and values.

Timing: per side, untimed warm-up generations (compilation, autotuning, graph capture), then a
whole generation of ``--new-tokens`` tokens and one of a single token (prefill + first token), each
from the host clock with the device synchronised before and after. Decode time per token =
``(t(new) - t(1)) / (new - 1)``: ``ms_per_token``; ``tokens_per_s = B / ms_per_token`` (B x new
tokens / time); ``prefill_ms = t(1)``. ``speedup`` = the fastest baseline's ``ms_per_token`` / the
graphed side's. The GPU's name and the host CPU's model (``lscpu``) are printed and recorded, since
a decode step of small kernels is host-bound when not graphed. Rows go to
``docs/perf/decode-<gpu>.json`` (the bench row format, docs/architecture.md): ``pass: "decode"``, ``shape`` like
``void125m B1 prompt128 new256``. ``graph_equals_eager``: the graphed and the eager generation
gave the same tokens (greedy, bf16: they run the same kernels).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import typing
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritonllm.bench.baseline_model import rope_tables
from tritonllm.models.transformer import release_decoders


class StaticCacheLlama(nn.Module):
    """The tritonllm architecture (dense SwiGLU; QK-norm, sliding window and untied head supported) in
    plain PyTorch for decoding with a static KV cache: ``forward(idx [B, T], pos [T] int64)`` writes
    the keys and values of positions ``pos`` into the cache and returns the logits of the last
    position ``[B, V]``. Parameters are named as tritonllm's, so its ``state_dict`` loads."""

    cos: torch.Tensor  # buffers registered in __init__: RoPE tables [max_seq_len, D/2], key positions [max_len]
    sin: torch.Tensor
    key_pos: torch.Tensor

    def __init__(self, cfg, batch: int, max_len: int, device, dtype=torch.bfloat16):
        super().__init__()
        if cfg.n_experts:
            raise ValueError("StaticCacheLlama: MoE models have no decode baseline")
        self.cfg, self.max_len = cfg, max_len
        L, d, D, Hq, Hkv = cfg.n_layers, cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        kw = dict(device=device, dtype=dtype)
        self.embed_weight = nn.Parameter(torch.empty(cfg.vocab_size, d, **kw))
        self.w = nn.ModuleList()
        for _ in range(L):
            weights = {"attn_norm": torch.empty(d, **kw), "qkv": torch.empty((Hq + 2 * Hkv) * D, d, **kw),
                     "proj": torch.empty(d, Hq * D, **kw), "mlp_norm": torch.empty(d, **kw),
                     "w13": torch.empty(2 * cfg.d_ff, d, **kw), "w2": torch.empty(d, cfg.d_ff, **kw)}
            if cfg.qk_norm:
                weights.update(q_norm=torch.empty(D, **kw), k_norm=torch.empty(D, **kw))
            self.w.append(nn.ParameterDict({k: nn.Parameter(v) for k, v in weights.items()}))
        self.norm_weight = nn.Parameter(torch.empty(d, **kw))
        tied = cfg.tie_embeddings
        self.head_weight = self.embed_weight if tied else nn.Parameter(torch.empty(cfg.vocab_size, d, **kw))
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        # one buffer per layer and tensor, written in place: under torch.compile a write into a view of
        # one stacked [L, ...] buffer is functionalised into a copy of the whole stack per layer
        for layer in range(L):
            for name in ("k", "v"):
                self.register_buffer(f"{name}_cache{layer}", torch.zeros(batch, Hkv, max_len, D, **kw),
                                     persistent=False)
        self.register_buffer("key_pos", torch.arange(max_len, device=device), persistent=False)

    @torch.no_grad()
    def load_tritonllm(self, model) -> None:
        """Copy the weights of a tritonllm ``Transformer`` of the same config."""
        self.embed_weight.copy_(model.embed.weight)
        for w, block in zip(self._layer_weights(), model.blocks):
            names = {"attn_norm": block.attn_norm.weight, "qkv": block.attn.qkv.weight, "proj": block.attn.proj.weight,
                     "mlp_norm": block.mlp_norm.weight, "w13": block.mlp.w13.weight, "w2": block.mlp.w2.weight}
            if self.cfg.qk_norm:
                names.update(q_norm=block.attn.q_norm.weight, k_norm=block.attn.k_norm.weight)
            for k, v in names.items():
                w[k].copy_(v)
        self.norm_weight.copy_(model.norm.weight)
        if not self.cfg.tie_embeddings:
            self.head_weight.copy_(model.head_weight)

    def _layer_weights(self) -> Iterable[nn.ParameterDict]:
        """``self.w``: per layer, its ParameterDict (an nn.ModuleList's items are typed as Module)."""
        return typing.cast("Iterable[nn.ParameterDict]", self.w)

    def _rope(self, x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T = idx.shape
        Hq, Hkv, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, T, D/2]
        lag = pos[:, None] - self.key_pos[None, :]  # [T, max_len]: query position - key position
        mask = lag >= 0
        if cfg.window is not None:
            mask = mask & (lag < cfg.window)
        x = F.embedding(idx, self.embed_weight)
        for layer, w in enumerate(self._layer_weights()):
            h = F.rms_norm(x, (cfg.d_model,), w["attn_norm"], eps)
            q, k, v = F.linear(h, w["qkv"]).view(B, T, Hq + 2 * Hkv, D).transpose(1, 2).split([Hq, Hkv, Hkv], dim=1)
            if cfg.qk_norm:
                q, k = F.rms_norm(q, (D,), w["q_norm"], eps), F.rms_norm(k, (D,), w["k_norm"], eps)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k_cache, v_cache = getattr(self, f"k_cache{layer}"), getattr(self, f"v_cache{layer}")
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=Hq != Hkv)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, Hq * D), w["proj"])
            gate, up = F.linear(F.rms_norm(x, (cfg.d_model,), w["mlp_norm"], eps), w["w13"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["w2"])
        return F.linear(F.rms_norm(x[:, -1], (cfg.d_model,), self.norm_weight, eps), self.head_weight)


def baseline_generate(model: StaticCacheLlama, step, idx: torch.Tensor, new_tokens: int, graphs: bool) -> torch.Tensor:
    """Greedy generation: eager prefill of ``idx``, then ``new_tokens - 1`` calls of
    ``step(token [B, 1], pos [1])`` (the model's decode step plus argmax, possibly compiled) with the
    position advanced in place on the device. ``graphs``: mark each step for CUDA-graph trees."""
    B, T = idx.shape
    with torch.no_grad():
        tok = model(idx, torch.arange(T, device=idx.device)).argmax(-1, keepdim=True)
        out = [tok]
        pos = torch.full((1,), T, dtype=torch.int64, device=idx.device)
        for _ in range(new_tokens - 1):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            tok = step(tok, pos).clone()
            pos += 1
            out.append(tok)
    return torch.cat([idx, *out], dim=1)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(generate, B: int, new_tokens: int) -> dict:
    """``generate(n)`` runs a whole generation of n new tokens; its decode figures (module docstring)."""
    generate(new_tokens)  # warm-up of both runs' shapes: compilation, autotuning, graph capture
    generate(1)
    total, prefill = _timed(lambda: generate(new_tokens)), _timed(lambda: generate(1))
    ms = max(total - prefill, 1e-9) / max(new_tokens - 1, 1) * 1e3
    return {"ms_per_token": round(ms, 4), "tokens_per_s": round(B / ms * 1e3, 1), "prefill_ms": round(prefill * 1e3, 3)}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_batch(model, B: int, args, gen: torch.Generator) -> dict:
    """Every side at batch ``B``; the result row."""
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), device="cuda", generator=gen)
    shape = f"{cfg.name} B{B} prompt{args.prompt_len} new{args.new_tokens}"
    row = {"op": "generate", "model": cfg.name, "shape": shape,
           "dtype": "bf16", "pass": "decode", "batch": B, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    sides, tokens = {}, {}
    for graph in (True, False):
        sides[graph] = measure(lambda n: model.generate(prompt, n, temperature=0.0, cuda_graph=graph), B,
                               args.new_tokens)
        tokens[graph] = model.generate(prompt, args.new_tokens, temperature=0.0, cuda_graph=graph)
    release_decoders(model)
    _free()
    row.update(sides[True], cuda_graph=True, eager=sides[False], baselines={},
               graph_equals_eager=bool(torch.equal(tokens[True], tokens[False])))
    max_len = args.prompt_len + args.new_tokens
    base = StaticCacheLlama(cfg, B, max_len, "cuda")
    base.load_tritonllm(model)
    with torch.no_grad():  # the weights loaded: first-token logits agree to bf16 rounding
        ours = model.generate(prompt, 1, temperature=0.0, cuda_graph=False)
        row["first_token_agrees"] = round((baseline_generate(base, None, prompt, 1, False) == ours)[:, -1]
                                          .float().mean().item(), 3)
    release_decoders(model)

    def eager_step(tok, pos):
        return base(tok, pos).argmax(-1, keepdim=True)

    for name in args.baselines:
        try:
            if name == "torch eager":
                step, graphs = eager_step, False
            else:
                torch._dynamo.reset()
                compiled = torch.compile(eager_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
                backends = [SDPBackend.MATH] if name == "reduce-overhead" else ALL_SDPA

                def step(tok, pos, compiled=compiled, backends=backends):
                    with sdpa_kernel(backends):
                        return compiled(tok, pos)
                graphs = True
            row["baselines"][name] = measure(lambda n: baseline_generate(base, step, prompt, n, graphs), B,
                                             args.new_tokens)
        except Exception as e:  # a baseline that fails is reported, not fatal
            row["baselines"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del base
    torch._dynamo.reset()
    _free()
    timed = {k: v for k, v in row["baselines"].items() if "ms_per_token" in v}
    if timed:
        fastest = min(timed, key=lambda k: timed[k]["ms_per_token"])
        row.update(fastest_baseline=fastest, speedup=round(timed[fastest]["ms_per_token"] / row["ms_per_token"], 3))
    return row


BASELINES = ("torch eager", "reduce-overhead", "reduce-overhead-sdpa")
DEFAULT_BASELINES = ("torch eager", "reduce-overhead")
ALL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def _parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m tritonllm.bench decode",
                                description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help=f"comma-separated, of: {', '.join(BASELINES)}")
    p.add_argument("--out", default="docs/perf", help="folder for decode-<gpu>.json")
    args, overrides = p.parse_known_args(argv)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        p.error(f"--batch must be comma-separated ints, got {args.batch!r}")
    if not args.batch or min(args.batch) < 1:
        p.error(f"--batch must name batch sizes >= 1, got {args.batch}")
    if args.prompt_len < 1 or args.new_tokens < 2:
        p.error(f"--prompt-len must be >= 1 and --new-tokens >= 2, got {args.prompt_len} and {args.new_tokens}")
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown:
        p.error(f"--baselines: unknown {unknown}; choose from {', '.join(BASELINES)}")
    return args, overrides


def _line(name: str, f: dict) -> str:
    if "error" in f:
        return f"  {name:<24}failed: {f['error']}"
    return f"  {name:<24}{f['ms_per_token']:>10.3f}{f['tokens_per_s']:>14,.0f}{f['prefill_ms']:>12.2f}"


def main(argv: list[str]) -> None:
    from tritonllm.bench.harness import write_results
    from tritonllm.bench.train import host_cpu_model
    from tritonllm.errors import TritonLLMError
    from tritonllm.models import ModelConfig, build_model
    from tritonllm.runtime import compose_config

    args, overrides = _parse(argv)
    if not torch.cuda.is_available():
        sys.exit("python -m tritonllm.bench decode needs a CUDA GPU")
    try:
        cfg = compose_config("train", overrides)
    except TritonLLMError as e:
        sys.exit(f"tritonllm: error: {e}")
    if cfg.get("model") is None:
        sys.exit("tritonllm: error: no model chosen: add +model=<name>")
    try:
        model_cfg = ModelConfig.from_dict(cfg.model)
    except (TypeError, ValueError) as e:
        sys.exit(f"tritonllm: error: model config: {e}")
    if args.prompt_len + args.new_tokens > model_cfg.max_seq_len:
        sys.exit(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds the model's "
                 f"max_seq_len {model_cfg.max_seq_len}")
    host_cpu = host_cpu_model()
    print(f"{torch.cuda.get_device_name()}, host CPU: {host_cpu}, torch {torch.__version__}", flush=True)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device="cuda", dtype=torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    rows = []
    for B in args.batch:
        row = run_batch(model, B, args, gen)
        rows.append(row)
        print(f"{row['shape']} bf16 greedy: {'side':<24}{'ms/token':>10}{'tokens/s':>14}{'prefill ms':>12}")
        print(_line("tritonllm (CUDA graph)", row))
        print(_line("tritonllm (eager)", row["eager"]))
        for name, f in row["baselines"].items():
            print(_line(f"baseline {name}", f))
        if row.get("speedup") is not None:
            print(f"  speedup {row['speedup']:.2f}x over the fastest baseline ({row['fastest_baseline']}); "
                  f"first tokens agree: {row['first_token_agrees']:.0%}", flush=True)
        path = write_results("decode", rows, args.out, extra={"host_cpu": host_cpu})
    print(f"wrote {path}")
