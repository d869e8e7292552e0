"""Typed schemas of the config groups (Hydra structured configs, registered in the ConfigStore).

Each YAML option of ``trainer/``, ``optim/``, ``sched/``, ``data/``, ``logger/``, ``generate.yaml`` and ``export.yaml``
starts its defaults list with its schema (``- /schema/<group>/<option>@_here_``), so a value of the
wrong type (``trainer.max_steps=2.5``, ``optim.lr=abc``) or a key the schema lacks fails when Hydra
composes the config, before anything runs. Ranges and allowed values, which OmegaConf does not
check, are in each field's metadata (``ge``, ``gt``, ``le``, ``lt``, ``choices``) and checked by
:func:`check_config` as the first thing ``train`` and ``generate`` do. The model config is typed by
:class:`tritonllm.models.ModelConfig`.

A key added to one of these YAML files needs its field here too (the composition test of every
option in ``tests/test_robustness.py`` fails otherwise).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

AUTO_BOOL = ("auto", True, False)


def _f(default, **rules):
    """A dataclass field with a default and range/choice rules for :func:`check_config`."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=rules)
    return field(default=default, metadata=rules)


# ----------------------------------------------------------------------------- trainer

@dataclass
class TrainerConfig:
    max_steps: int = _f(5000, ge=1)
    batch_size: int = _f(16, ge=1)
    seq_len: int = _f(1024, ge=1)
    grad_accum: int = _f(1, ge=1)
    grad_clip: Optional[float] = _f(1.0, gt=0)
    dtype: str = _f("auto", choices=("auto", "bf16", "fp32"))
    precision: str = _f("bf16", choices=("bf16", "fp8"))
    fp8_grad_dtype: str = _f("e4m3", choices=("e4m3", "e5m2"))
    activation_checkpointing: str = _f("none", choices=("none", "full"))
    eval_interval: int = _f(250, ge=1)
    eval_batches: int = _f(20, ge=1)
    log_interval: int = _f(10, ge=1)
    ckpt_interval: Optional[int] = _f(1000, ge=0)  # 0 or null: only at the end
    keep_last: Optional[int] = _f(3, ge=0)  # 0 or null: keep every checkpoint
    ckpt_dir: str = MISSING
    resume: Optional[str] = None
    resume_force: bool = False
    checkpoint_on_signal: bool = True
    max_bad_steps: int = _f(5, ge=1)
    parallel: str = _f("auto", choices=("auto", "ddp", "fsdp", "none"))
    gemm_grid: str = _f("dynamic", choices=("dynamic", "tile", "persistent"))
    gemm_sm_margin: int = _f(0, ge=0)
    dist_timeout_s: float = _f(300.0, gt=0)
    cuda_graph: Any = _f("auto", choices=AUTO_BOOL)
    peak_flops: float = _f(989e12, gt=0)
    progress: bool = True
    sample_prompt: str = "def "
    sample_tokens: int = _f(0, ge=0)
    sample_interval: Optional[int] = _f(None, ge=0)  # 0 or null: only at the end
    gpu_telemetry: bool = True
    control: bool = True


# ----------------------------------------------------------------------------- optim

@dataclass
class AdamWConfig:
    name: str = _f("adamw", choices=("adamw",))
    lr: float = _f(6.0e-4, gt=0)
    betas: List[float] = _f([0.9, 0.95])
    eps: float = _f(1.0e-8, gt=0)
    weight_decay: float = _f(0.1, ge=0)
    master_weights: Any = _f("auto", choices=AUTO_BOOL)


@dataclass
class MuonParams:
    lr: float = _f(0.02, gt=0)
    momentum: float = _f(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = _f(0.0, ge=0)
    coefficients: str = _f("polar_express", choices=("polar_express", "newton_schulz"))
    ns_steps: int = _f(5, ge=1)
    normuon: bool = False
    beta2: float = _f(0.95, ge=0, lt=1)
    adjust_lr: str = _f("original", choices=("original", "match_rms_adamw", "none"))


@dataclass
class MuonConfig(AdamWConfig):
    name: str = _f("muon", choices=("muon",))
    lr: float = _f(8.0e-3, gt=0)
    weight_decay: float = _f(0.0, ge=0)
    muon: MuonParams = field(default_factory=MuonParams)


# ----------------------------------------------------------------------------- sched

@dataclass
class ConstantSched:
    name: str = _f("constant", choices=("constant",))
    warmup_steps: int = _f(100, ge=0)


@dataclass
class CosineSched:
    name: str = _f("cosine", choices=("cosine",))
    warmup_steps: int = _f(100, ge=0)
    min_lr_ratio: float = _f(0.1, ge=0, le=1)


@dataclass
class WsdSched:
    name: str = _f("wsd", choices=("wsd",))
    warmup_steps: int = _f(100, ge=0)
    min_lr_ratio: float = _f(0.0, ge=0, le=1)
    decay_fraction: float = _f(0.2, ge=0, le=1)
    decay_shape: str = _f("linear", choices=("linear", "sqrt", "cosine"))


# ----------------------------------------------------------------------------- data

@dataclass
class _DataFiles:
    """The keys shared by the data kinds that read the files a glob matches."""
    kind: str = MISSING
    files: str = MISSING
    val_files: Optional[str] = None
    val_fraction: float = _f(0.05, ge=0, lt=1)
    tokenizer: Optional[str] = None


@dataclass
class BinData(_DataFiles):
    kind: str = _f("bin", choices=("bin",))
    val_fraction: float = _f(0.01, ge=0, lt=1)
    vocab_size: Optional[int] = _f(None, ge=1)
    cache_dir: Optional[str] = None


@dataclass
class SftData(_DataFiles):
    kind: str = _f("sft", choices=("sft",))
    chat_template: bool = True
    pack: bool = False


@dataclass
class StdlibData:
    kind: str = _f("stdlib", choices=("stdlib",))
    packages: bool = False
    max_bytes: Optional[int] = _f(20000000, ge=1)
    vocab_size: int = _f(8192, ge=2)
    tokenizer_bytes: Optional[int] = _f(None, ge=1)
    val_fraction: float = _f(0.05, gt=0, lt=1)
    cache_dir: str = MISSING


@dataclass
class TextData:
    kind: str = _f("text", choices=("text",))
    files: str = MISSING
    tokenizer: Optional[str] = None
    vocab_size: int = _f(8192, ge=2)
    max_bytes: Optional[int] = _f(None, ge=1)
    tokenizer_bytes: Optional[int] = _f(100000000, ge=1)
    val_fraction: float = _f(0.05, gt=0, lt=1)
    cache_dir: str = MISSING


# ----------------------------------------------------------------------------- logger

@dataclass
class LocalLogger:
    backend: str = _f("local", choices=("local",))


@dataclass
class WandbLogger:
    backend: str = _f("wandb", choices=("wandb",))
    project: str = "tritonllm"
    entity: Optional[str] = None
    mode: str = _f("offline", choices=("offline", "online", "disabled"))
    group: Optional[str] = None
    tags: List[str] = _f([])


# ----------------------------------------------------------------------------- generate

@dataclass
class GenerateConfig:
    ckpt: Optional[str] = None
    hf: Optional[str] = None
    tokenizer: Optional[str] = None
    prompt: str = ""
    chat: bool = False
    max_new_tokens: int = _f(200, ge=1)
    temperature: float = _f(0.8, ge=0)
    top_k: Optional[int] = _f(200, ge=1)
    top_p: Optional[float] = _f(None, gt=0, le=1)
    num_samples: int = _f(1, ge=1)
    seed: int = 1337
    device: str = "auto"
    dtype: str = _f("auto", choices=("auto", "bf16", "fp32"))
    context: Optional[int] = _f(None, ge=1)
    rope_scaling: str = _f("yarn", choices=("yarn", "ntk", "linear"))


# ----------------------------------------------------------------------------- export (conf/export.yaml)

@dataclass
class ExportConfig:
    ckpt: Optional[str] = None
    out: Optional[str] = None
    adapters_only: bool = False
    dtype: str = _f("auto", choices=("auto", "bf16", "fp16", "fp32"))
    architecture: Optional[str] = None  # checked by tritonllm.hf.hf_config_from
    overwrite: bool = False
    device: str = "auto"


# ----------------------------------------------------------------------------- evolve (conf/evolve.yaml)

@dataclass
class EvolveSampler:
    seed: int = 1337
    crossover_prob: float = _f(0.9, ge=0, le=1)
    mutation_prob: Optional[float] = _f(None, gt=0, le=1)


@dataclass
class EvolveSandbox:
    timeout_s: Optional[float] = _f(3600.0, gt=0)
    host_memory_gb: Optional[float] = _f(None, gt=0)
    enforce_memory_cap: bool = True


@dataclass
class EvolveConfig:
    """``evolve:`` of ``conf/evolve.yaml`` (ranges the search checks itself: tritonllm/evolve/search.py)."""
    budget: Any = "20M"  # tokens (int or "500k", "20M") or time ("90s", "5min") per candidate
    population: int = 8
    generations: int = 4
    include_seed: bool = True
    mutants: float = 0.25
    max_proposals: int = _f(20, ge=1)
    objectives: List[str] = _f(["val_loss", "tokens_per_s", "peak_mem_gb"])
    memory_cap_gb: Optional[float] = _f(None, gt=0)
    max_params: Optional[int] = _f(None, ge=1)
    multiple_of: int = _f(64, ge=1)
    keep_checkpoints: bool = False
    warm_start: bool = False
    evaluator: str = "tritonllm.evolve.evaluate:evaluate_candidate"
    sampler: EvolveSampler = field(default_factory=EvolveSampler)
    sandbox: EvolveSandbox = field(default_factory=EvolveSandbox)
    space: Dict[str, Any] = field(default_factory=dict)  # gene -> choices (conf/evolve_space)


SCHEMAS = {
    "trainer": {"default": TrainerConfig},
    "optim": {"adamw": AdamWConfig, "muon": MuonConfig},
    "sched": {"constant": ConstantSched, "cosine": CosineSched, "wsd": WsdSched},
    "data": {"bin": BinData, "sft": SftData, "stdlib": StdlibData, "text": TextData},
    "logger": {"local": LocalLogger, "wandb": WandbLogger},
}


def register() -> None:
    """Store every schema in Hydra's ConfigStore (``schema/<group>/<option>``, ``schema/generate``,
    ``schema/export``, ``schema/evolve``)."""
    cs = ConfigStore.instance()
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    cs.store(group="schema", name="generate", node=GenerateConfig)
    cs.store(group="schema", name="export", node=ExportConfig)
    cs.store(group="schema", name="evolve", node=EvolveConfig)


BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _rule_error(key: str, value, rules: dict) -> str | None:
    if "choices" in rules:
        if value in rules["choices"]:
            return None
        if len(rules["choices"]) == 1:  # the field naming the option of its group (sched.name, data.kind)
            group = key.rpartition(".")[0]
            return (f"{key}={value!r} does not name this {group} option ({rules['choices'][0]}): choose another "
                    f"option with {group}=<option>, not by changing {key}")
        allowed = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in rules["choices"])
        return f"{key}={value!r} is not one of {allowed}"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for rule, words in BOUNDS.items():
        if rule in rules and not COMPARE[rule](value, rules[rule]):
            return f"{key} must be {words} {rules[rule]}, got {value!r}"
    return None


def config_errors(node, prefix: str = "") -> list[str]:
    """The rule violations (metadata of the schema fields) of every typed node under ``node``."""
    errors = []
    if not isinstance(node, DictConfig):
        return errors
    schema = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            errors += config_errors(child, f"{prefix}{key}.")
        elif key in fields and child._is_missing():
            errors.append(f"{prefix}{key} must be set ({prefix}{key}=<value>)")
        elif key in fields and fields[key].metadata:
            message = _rule_error(f"{prefix}{key}", node[key], fields[key].metadata)
            errors += [message] if message else []
    return errors


def check_config(cfg) -> None:
    """A ConfigError listing every value of ``cfg`` outside its schema's range or choices."""
    from tritonllm.errors import ConfigError

    errors = config_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))
