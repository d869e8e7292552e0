"""Sharded training checkpoints through ``torch.distributed.checkpoint`` (DCP), for runs under torchrun.

A checkpoint is a folder ``<ckpt_dir>/step_<00000123>/`` (found by
:func:`tritonllm.checkpoint.find_checkpoint` like a single-process one) holding

- DCP's files (``.metadata``, ``__<rank>_0.distcp``): ``model.<name>`` every weight and
  ``optim.<name>.<key>`` the optimizer's state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``; Muon's
  ``momentum_buffer`` and NorMuon's ``second_moment``; when kept, ``master``), each rank writing its own shards (FSDP2) or one rank a replicated tensor (DDP);
- ``rng_rank<r>.pt``: each rank's RNG states;
- ``state.json`` (step, data position, model config, ...), ``config.yaml``, ``tokenizer.model``: rank 0.

Atomic: every rank writes into ``.tmp-step_<n>``; when all of them succeeded (a vote over the
ranks) rank 0 writes ``state.json`` and renames the folder into place, so a checkpoint is complete or
absent. Loading reshards: DCP reads, for each tensor of this run, the parts its rank holds, whatever
the world size and layout that saved it (2 ranks of FSDP2 into 1 process, 1 into 2, DDP into FSDP2).
A single process without a process group reads one as well (``python -m tritonllm.train`` resuming
a torchrun run's checkpoint). A missing ``master`` (the checkpoint came from fp32 weights) is rebuilt
from the loaded weights; when this run's weights are fp32 and the checkpoint kept fp32 masters of
lower-precision weights, the masters are loaded into the weights.

A single-process checkpoint (:func:`tritonllm.checkpoint.save_checkpoint`: ``model.safetensors``,
``optimizer.pt``) resumes under FSDP2 through :func:`load_full_into_shards`: every rank reads the full
weights and optimizer state and keeps its own shards of them.

``python -m tritonllm.train.dist_checkpoint export <ckpt> <folder>`` writes a single-process checkpoint
folder (``model.safetensors`` with the full weights, ``state.json``, ``config.yaml``, the tokenizer) that
``python -m tritonllm.generate ckpt=<folder>`` loads.
"""

from __future__ import annotations

import os
import shutil

import torch

from tritonllm.checkpoint import (CONFIG_FILE, MODEL_FILE, OPTIM_FILE, RNG_FILE, STATE_FILE, TMP_PREFIX,
                                  TOKENIZER_FILE, _write_json, check_finite_weights, check_model_shapes, prune,
                                  publish, read_state, rng_state, set_rng_state, verify_checkpoint, with_checksums)
from tritonllm.errors import CheckpointError

METADATA_FILE = ".metadata"


def is_sharded(path: str) -> bool:
    """Whether the checkpoint folder ``path`` was written by :func:`save_sharded`."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _optim_state(module: torch.nn.Module, optimizer) -> dict:
    """``{name: {key: tensor}}``: the optimizer's state of each named parameter (DTensors when sharded)."""
    return {name: {k: v for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
            for name, p in module.named_parameters() if optimizer.state.get(p)}


def _agree(env, error: str | None) -> list[str]:
    """Every rank's error (``rank r: message``) after a step each rank did on its own."""
    if not env.distributed:
        return [f"rank 0: {error}"] if error else []
    errors = [None] * env.world_size
    torch.distributed.all_gather_object(errors, error)
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def save_sharded(ckpt_dir: str, step: int, env, module: torch.nn.Module, optimizer, state: dict,
                 config_yaml: str | None = None, tokenizer_path: str | None = None,
                 keep_last: int | None = None, run_id: str | None = None) -> str:
    """Write checkpoint ``step`` of every rank's shards into ``ckpt_dir`` (collective: every rank
    calls it) and keep the newest ``keep_last`` of the run ``run_id`` (:func:`tritonllm.checkpoint.prune`). Returns the checkpoint's path. A CheckpointError
    naming the ranks that failed is raised on every rank; nothing under ``step_*`` changes then."""
    import torch.distributed.checkpoint as dcp

    from tritonllm.train.parallel import barrier

    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = os.path.join(ckpt_dir, f"{TMP_PREFIX}{step:08d}")
    if env.main:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(env)
    error = None
    try:
        dcp.save({"model": module.state_dict(), "optim": _optim_state(module, optimizer)}, checkpoint_id=tmp)
        rng_path = os.path.join(tmp, _rng_file(env.rank))
        torch.save(rng_state(), rng_path)
        with open(rng_path, "rb") as f:
            os.fsync(f.fileno())
    except Exception as e:  # noqa: BLE001 -- reported on every rank below
        error = f"{type(e).__name__}: {e}"
    errors = _agree(env, error)
    if not errors and env.main:
        try:
            publish(tmp, final, {**state, "step": step, "world_size": env.world_size,
                                 **({"run_id": run_id} if run_id is not None else {})}, config_yaml, tokenizer_path)
            prune(ckpt_dir, keep_last, run_id)
        except Exception as e:  # noqa: BLE001 -- reported on every rank below
            error = f"{type(e).__name__}: {e}"
    errors = errors or _agree(env, error if env.main else None)
    if errors:
        if env.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {final} failed ({'; '.join(errors)}); earlier checkpoints in "
                              f"{ckpt_dir} are untouched")
    return final


def _saved_shapes(path: str) -> dict:
    """``{key: global shape}`` of every tensor in the DCP checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp

    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {METADATA_FILE} is unreadable ({type(e).__name__}: {e})") from None
    return {k: tuple(m.size) for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}


def _check_model(path: str, saved: dict, model_sd: dict, saved_config: dict | None, config: dict | None) -> None:
    problems = [f"{k}: missing from the checkpoint" for k in model_sd if f"model.{k}" not in saved]
    problems += [f"{k}: {saved[f'model.{k}']} saved, {tuple(v.shape)} in this model" for k, v in model_sd.items()
                 if f"model.{k}" in saved and saved[f"model.{k}"] != tuple(v.shape)]
    problems += [f"{k[6:]}: in the checkpoint, not in this model" for k in saved
                 if k.startswith("model.") and k[6:] not in model_sd]
    if problems:
        saved_fields, fields_now = saved_config or {}, config or {}
        fields = [f"{k}={saved_fields.get(k)!r} saved vs {fields_now.get(k)!r}" for k in sorted(fields_now)
                  if saved_config and saved_fields.get(k) != fields_now.get(k)]
        diff = "; model config differences: " + ", ".join(fields) if fields else ""
        raise CheckpointError(f"checkpoint {path} was written for a different model shape ({len(problems)} "
                              f"tensors differ: {'; '.join(problems[:6])}){diff}")


def load_sharded(path: str, env, module: torch.nn.Module, optimizer=None, restore_rng: bool = True,
                 model_config: dict | None = None, verified: bool = False) -> dict:
    """Load the checkpoint ``path`` into ``module`` (sharded or not) and ``optimizer`` on every rank
    (collective under a process group); returns its ``state.json``. A CheckpointError names what
    is missing, unreadable or does not fit."""
    import torch.distributed.checkpoint as dcp

    state = read_state(path) if verified else verify_checkpoint(path)  # verified: checksums just checked
    saved = _saved_shapes(path)
    model_sd = module.state_dict()
    _check_model(path, saved, model_sd, state.get("model_config"), model_config)
    request = {"model": model_sd}
    optim_sd, fill_master, masters_into_weights = {}, [], []
    if optimizer is not None:
        optimizer.init_state()
        params = dict(module.named_parameters())
        for name, st in _optim_state(module, optimizer).items():
            optim_sd[name] = {k: v for k, v in st.items() if f"optim.{name}.{k}" in saved}
            if "master" in st and "master" not in optim_sd[name]:
                fill_master.append((params[name], st["master"]))
            if "master" not in st and f"optim.{name}.master" in saved and params[name].dtype == torch.float32:
                masters_into_weights.append(name)
            missing = [k for k in st if k != "master" and k not in optim_sd[name]]
            if missing:  # AdamW's step and moments, Muon's momentum (and NorMuon's second moment)
                raise CheckpointError(f"checkpoint {path} holds no optimizer state {', '.join(missing)} for {name}")
        request["optim"] = optim_sd
    try:
        dcp.load(request, checkpoint_id=path)
        if masters_into_weights:  # fp32 weights here, fp32 masters there: the masters are the weights
            dcp.load({"optim": {n: {"master": model_sd[n]} for n in masters_into_weights}}, checkpoint_id=path)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e})") from None
    module.load_state_dict(model_sd)
    with torch.no_grad():
        for p, master in fill_master:
            master.copy_(p)
    if restore_rng:
        rng = os.path.join(path, _rng_file(env.rank))
        if os.path.isfile(rng):
            set_rng_state(torch.load(rng, map_location="cpu", weights_only=True))
    return state


def _copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor ``full`` into ``target``: into this rank's shard of it when ``target`` is
    a DTensor (``distribute_tensor`` cuts the shards of rank 0's ``full``), else whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        target.to_local().copy_(distribute_tensor(full, target.device_mesh, target.placements).to_local())
    else:
        target.copy_(full)


@torch.no_grad()
def load_full_into_shards(path: str, env, module: torch.nn.Module, optimizer=None, restore_rng: bool = True,
                          model_config: dict | None = None, verified: bool = False) -> dict:
    """Load the single-process checkpoint ``path`` (``model.safetensors``, ``optimizer.pt``, ``rng.pt``)
    into ``module``, sharded by FSDP2, and its ``optimizer`` (AdamW, or ``optim=muon``'s Muon and AdamW;
    collective: every rank calls it);
    returns its ``state.json``.

    Every rank reads the full weights and optimizer state on the CPU and copies its own shards into
    the parameters and the moments (:func:`_copy_full_`). The saved optimizer's parameters are
    matched to this one's by order, as ``torch.optim.Optimizer.load_state_dict`` does (the same
    model builds the same groups). A saved fp32 ``master`` of a lower-precision weight becomes the
    weight when this run's parameter is fp32 (FSDP2's sharded master weights). Rank 0 restores the
    saved RNG states (the other ranks keep their seeded ones, as when a sharded checkpoint of fewer
    ranks resumes). A CheckpointError names the file that is unreadable or does not fit."""
    from safetensors.torch import load_file

    state = read_state(path) if verified else verify_checkpoint(path)
    check_model_shapes(path, module, state.get("model_config"), model_config)
    file = os.path.join(path, MODEL_FILE)
    try:
        weights = load_file(file, device="cpu")
        saved = None
        if optimizer is not None:
            file = os.path.join(path, OPTIM_FILE)
            saved = torch.load(file, map_location="cpu", weights_only=True)
        file = os.path.join(path, RNG_FILE)
        rng = torch.load(file, map_location="cpu", weights_only=True) if restore_rng and env.main else None
    except Exception as e:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {e})") from None
    pairs, groups = [], []  # (parameter, its saved optimizer state), (group, its saved group)
    if saved is not None:
        # a CombinedOptimizer (optim=muon) saves one state dict per optimizer, in order
        optimizers = getattr(optimizer, "optimizers", [optimizer])
        saved_all = saved.get("optimizers", [saved])
        if len(saved_all) != len(optimizers):
            raise CheckpointError(f"checkpoint file {file} holds the state of {len(saved_all)} optimizer(s), this "
                                  f"run has {len(optimizers)}")
        for opt, sd in zip(optimizers, saved_all):
            params = [p for g in opt.param_groups for p in g["params"]]
            saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
            if len(sd["param_groups"]) != len(opt.param_groups) or len(saved_ids) != len(params):
                raise CheckpointError(f"checkpoint file {file} holds {len(saved_ids)} parameters in "
                                      f"{len(sd['param_groups'])} groups, this optimizer {len(params)} in "
                                      f"{len(opt.param_groups)}")
            pairs += [(p, sd["state"].get(i) or {}) for p, i in zip(params, saved_ids)]
            groups += list(zip(opt.param_groups, sd["param_groups"]))
        names = {id(p): n for n, p in module.named_parameters()}
        for p, st in pairs:  # fp32 weights here, fp32 masters there: the masters are the weights
            if "master" in st and p.dtype == torch.float32 and id(p) in names:
                weights[names[id(p)]] = st["master"]
    check_finite_weights(path, weights)
    targets = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    for name, full in weights.items():
        _copy_full_(targets[name], full)
    if saved is not None:
        optimizer.init_state()
        for p, st in [(p, st) for p, st in pairs if st]:  # a parameter never updated keeps zero state
            mine = optimizer.state[p]
            if "step" in mine:  # AdamW's count (Muon keeps none)
                mine["step"].fill_(float(st["step"]))
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "second_moment", "master"):
                if key in mine and key in st:
                    _copy_full_(mine[key], st[key])
                elif key == "master" and key in mine:  # a master copy the saving run did not keep: the weight
                    mine[key].copy_(p)
        for group, saved_group in groups:
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    if rng is not None:
        set_rng_state(rng)
    return state


def export(path: str, out_dir: str) -> str:
    """Write the weights of the sharded checkpoint ``path`` as a single-process checkpoint folder
    ``out_dir`` (``model.safetensors``, ``state.json``, ``config.yaml``, the tokenizer) that
    ``python -m tritonllm.generate ckpt=<out_dir>`` loads. Runs in one process, on the CPU."""
    from safetensors.torch import save_model

    from tritonllm.models import build_model
    from tritonllm.train.parallel import DistEnv

    if not is_sharded(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {METADATA_FILE})")
    state = read_state(path)
    if "model_config" not in state:
        raise CheckpointError(f"checkpoint {path} has no model_config in {STATE_FILE}")
    model = build_model(state["model_config"], device="cpu", dtype=torch.float32)
    load_sharded(path, DistEnv(), model, restore_rng=False, model_config=state["model_config"])
    os.makedirs(out_dir, exist_ok=True)
    save_model(model, os.path.join(out_dir, MODEL_FILE))
    written = [MODEL_FILE]
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        if os.path.isfile(os.path.join(path, name)):
            shutil.copyfile(os.path.join(path, name), os.path.join(out_dir, name))
            written.append(name)
    _write_json(os.path.join(out_dir, STATE_FILE), with_checksums(out_dir, {
        "step": state.get("step"), "model_config": state["model_config"], "exported_from": os.path.abspath(path)},
        written))
    return out_dir


def main(argv=None) -> None:
    from tritonllm.runtime import ArgumentParser

    parser = ArgumentParser(prog="python -m tritonllm.train.dist_checkpoint", description="Sharded (torchrun) checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a single-process checkpoint folder that tritonllm.generate loads")
    exp.add_argument("ckpt", help="a sharded checkpoint (step_* folder) or a folder of them (the newest)")
    exp.add_argument("out", help="output folder")
    args = parser.parse_args(argv)
    from tritonllm.checkpoint import find_checkpoint

    found = find_checkpoint(args.ckpt)
    if found is None:
        raise CheckpointError(f"{args.ckpt} holds no checkpoint (a step_* folder with {STATE_FILE})")
    print(export(found, args.out))


if __name__ == "__main__":
    from tritonllm.runtime import exit_on_user_error

    exit_on_user_error(main)()
