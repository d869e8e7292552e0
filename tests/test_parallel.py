"""Training on several processes (tritonllm.train.parallel, tritonllm.train.dist_checkpoint) on the CPU:
gloo, the Triton interpreter, void_tiny shrunk, four steps of two micro-batches.

One process with the global batch is the reference. Against it: DDP and FSDP2 on two processes
(torchrun), FSDP2 on one process of a process group; sharded checkpoints saved on two ranks and
resumed in one plain process, saved on one rank and resumed on two, a single-process (safetensors)
checkpoint resumed by FSDP2 on two; the export that generation
loads; and a rank that fails ending every rank within a minute with its rank and message. The same
with optim=muon (Muon + AdamW) against one Muon process: DDP, FSDP2 (whole matrices orthogonalised
from gathered shards), its checkpoints resumed across world sizes; Muon on DTensor shards of odd
shapes against Muon on the full matrices (tests/_muon_shard_worker.py). The multi-node launch: two
torchrun agents joined through a c10d rendezvous on localhost running ``python -m tritonllm.train``.
The data shares, the sharded norm reduction and AdamW on an empty shard are checked in process."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from _checks import ON_GPU, child_env
from test_train import ROOT, TINY, compose_train, data_overrides, read_metrics  # noqa: F401 (fixture)

from tritonllm.data.loader import TokenLoader, TokenStream
from tritonllm.errors import ConfigError
from tritonllm.runtime import descendants
from tritonllm.kernels.adamw import adamw_step_, clip_grads_
from tritonllm.train import train
from tritonllm.train.dist_checkpoint import export, is_sharded

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
#: the gloo runs compute on CPU tensors, which the kernels take only under the interpreter
cpu_only = pytest.mark.skipif(ON_GPU, reason="gloo on the CPU interpreter; on GPUs: test_gpu_two_ranks")

WORKER = os.path.join(ROOT, "tests", "_dist_worker.py")
#: the global batch: 4 sequences x 2 micro-batches; on two ranks 2 sequences each
ONE = ["device=cpu", "trainer.batch_size=4", "trainer.grad_accum=2"]
TWO = ["device=cpu", "trainer.batch_size=2", "trainer.grad_accum=2"]
#: after ONE / TWO: Muon (lr 0.02) for the block matrices, AdamW (TINY's optim.lr) for the rest; three
#: steps of one micro-batch (the accumulation is the AdamW runs' to test), checkpoints at 2 and 3
MUON = ["optim=muon", "trainer.grad_accum=1", "trainer.max_steps=3"]
FP8 = ["trainer.precision=fp8", "trainer.max_steps=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agents(cmds: list[list[str]], tmp, timeout: float, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """Start each command (a torchrun agent) in a session of its own, its stdout and stderr into files
    under ``tmp`` (not pipes: a pipe's reader also waits for every process that inherited it), and wait
    ``timeout`` s for all of them. Should any still run then, it and every process below it (torchrun
    starts each rank in a session of its own) get SIGABRT -- with PYTHONFAULTHANDLER=1, which is set
    here, a Python process prints its threads' stacks first -- then SIGKILL, and the test fails with
    every agent's output and those stacks."""
    deadline, agents, files = time.monotonic() + timeout, [], []
    for i, cmd in enumerate(cmds):
        files.append([os.path.join(tmp, f"agent{i}-{time.monotonic_ns()}.{name}") for name in ("out", "err")])
        with open(files[-1][0], "w") as out, open(files[-1][1], "w") as err:
            agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp, start_new_session=True,
                                           env={**env, "PYTHONFAULTHANDLER": "1"}))
    for a in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            a.wait(timeout=max(deadline - time.monotonic(), 0.1))
    stuck = [pid for a in agents if a.poll() is None for pid in (a.pid, *descendants(a.pid))]
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in stuck:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if stuck and sig == signal.SIGABRT:
            time.sleep(5)  # the stacks reach the files
    results = []
    for a, cmd, (out, err) in zip(agents, cmds, files):
        a.wait()
        with open(out) as f_out, open(err) as f_err:
            results.append(subprocess.CompletedProcess(cmd, a.returncode, f_out.read(), f_err.read()))
    if stuck:
        pytest.fail(f"still running after {timeout} s (pids {stuck}, ended); each agent's output and stacks:\n"
                    + "\n-----\n".join(r.stdout[-4000:] + r.stderr[-8000:] for r in results))
    return results

def torchrun(spec, tmp, nproc: int = 2, timeout: float = 300, worker: str = WORKER) -> subprocess.CompletedProcess:
    """``worker`` on ``nproc`` processes; its argument: ``spec`` written to a JSON file, or a path (str)."""
    path = spec
    if not isinstance(spec, str):
        path = os.path.join(tmp, f"spec-{time.monotonic_ns()}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", worker, path]
    return run_agents([cmd], tmp, timeout, child_env(os.path.join(ROOT, "tests"), OMP_NUM_THREADS="1"))[0]


def losses(out) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(str(out), "train")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_overrides):
    """Every run's folder: ``ref`` (one process, global batch), ``fsdp1`` (FSDP2 on a one-rank group),
    ``ddp`` / ``fsdp`` (two ranks), ``fsdp_from1`` (two ranks resuming fsdp1's step 2), ``fsdp_from_plain``
    (two FSDP2 ranks resuming ref's single-process step 2) and ``plain_from2`` (one plain process
    resuming the two-rank FSDP2 step 2); with optim=muon: ``muon_ref``, ``muon_ddp``, ``muon_fsdp``,
    ``muon_fsdp_from_plain`` (muon_ref's step 2) and ``muon_plain_from2`` (muon_fsdp's step 2); with
    trainer.precision=fp8: ``fp8_ref``, ``fp8_ddp``, ``fp8_fsdp``."""
    tmp = tmp_path_factory.mktemp("parallel")
    base = [*TINY, *data_overrides]
    out = {name: tmp / name for name in ("ref", "fsdp1", "ddp", "fsdp", "fsdp_from1", "fsdp_from_plain",
                                         "plain_from2", "muon_ref", "muon_ddp", "muon_fsdp", "muon_fsdp_from_plain",
                                         "muon_plain_from2", "fp8_ref", "fp8_ddp", "fp8_fsdp")}
    train(compose_train(*base, *ONE, f"out_dir={out['ref']}"))
    train(compose_train(*base, *ONE, *MUON, f"out_dir={out['muon_ref']}"))
    train(compose_train(*base, *ONE, *FP8, f"out_dir={out['fp8_ref']}"))
    group_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}
    saved = {k: os.environ.get(k) for k in group_env}
    os.environ.update(group_env)
    try:  # as under torchrun --nproc_per_node=1: train() makes a one-rank gloo group and destroys it
        train(compose_train(*base, *ONE, "trainer.parallel=fsdp", f"out_dir={out['fsdp1']}"))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    r = torchrun({"runs": [
        [*base, *TWO, "trainer.parallel=ddp", f"out_dir={out['ddp']}"],
        [*base, *TWO, "trainer.parallel=fsdp", f"out_dir={out['fsdp']}"],
        [*base, *TWO, "trainer.parallel=fsdp", f"out_dir={out['fsdp_from1']}",
         f"trainer.resume={out['fsdp1']}/checkpoints/step_00000002"],
        [*base, *TWO, "trainer.parallel=fsdp", f"out_dir={out['fsdp_from_plain']}",
         f"trainer.resume={out['ref']}/checkpoints/step_00000002"],
        [*base, *TWO, *MUON, "trainer.parallel=ddp", f"out_dir={out['muon_ddp']}"],
        [*base, *TWO, *MUON, "trainer.parallel=fsdp", f"out_dir={out['muon_fsdp']}"],
        [*base, *TWO, *MUON, "trainer.parallel=fsdp", f"out_dir={out['muon_fsdp_from_plain']}",
         f"trainer.resume={out['muon_ref']}/checkpoints/step_00000002"],
        [*base, *TWO, *FP8, "trainer.parallel=ddp", f"out_dir={out['fp8_ddp']}"],
        [*base, *TWO, *FP8, "trainer.parallel=fsdp", f"out_dir={out['fp8_fsdp']}"]]}, tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    train(compose_train(*base, *ONE, f"out_dir={out['plain_from2']}",
                        f"trainer.resume={out['fsdp']}/checkpoints/step_00000002"))
    train(compose_train(*base, *ONE, *MUON, f"out_dir={out['muon_plain_from2']}",
                        f"trainer.resume={out['muon_fsdp']}/checkpoints/step_00000002"))
    return out


def assert_losses_close(got: dict, ref: dict, steps) -> None:
    assert sorted(got) == list(steps), got
    # the same sums in another order (gradients averaged over ranks, shards reduced): fp32 rounding
    assert all(abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]) for s in steps), (got, ref)


@cpu_only
def test_ddp_and_fsdp_match_one_process(runs):
    ref = losses(runs["ref"])
    assert len(ref) == 4 and ref[4] < ref[1]
    for name in ("ddp", "fsdp", "fsdp1"):
        assert_losses_close(losses(runs[name]), ref, [1, 2, 3, 4])
        val, ref_val = read_metrics(str(runs[name]), "val"), read_metrics(str(runs["ref"]), "val")
        assert [v["step"] for v in val] == [2, 4]
        assert all(abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"] for a, b in zip(val, ref_val))
        train_rec = read_metrics(str(runs[name]), "train")[0]
        assert train_rec["tokens"] == 4 * 32 * 2  # the global batch, whatever the number of ranks


@cpu_only
def test_sharded_checkpoints_resume_on_another_world_size(runs):
    ref = losses(runs["ref"])
    for name in ("ddp", "fsdp", "fsdp1"):
        ckpts = sorted(os.listdir(runs[name] / "checkpoints"))
        assert ckpts == ["step_00000002", "step_00000004"], ckpts  # no temporary folder left
        for c in ckpts:
            path = str(runs[name] / "checkpoints" / c)
            assert is_sharded(path) and os.path.isfile(os.path.join(path, "rng_rank0.pt"))
    assert json.load(open(runs["fsdp"] / "checkpoints" / "step_00000002" / "state.json"))["world_size"] == 2
    assert_losses_close(losses(runs["plain_from2"]), ref, [3, 4])  # saved on 2 ranks, resumed in 1 process
    assert_losses_close(losses(runs["fsdp_from1"]), ref, [3, 4])  # saved on 1 rank, resumed on 2


@cpu_only
def test_single_process_checkpoint_resumes_under_fsdp(runs):
    """ref's safetensors checkpoint (one plain process) resumed by FSDP2 on two ranks: every rank
    reads it whole and keeps its shards of the weights and AdamW's moments; the losses and the
    validation loss are the uninterrupted run's."""
    plain = str(runs["ref"] / "checkpoints" / "step_00000002")
    assert not is_sharded(plain) and os.path.isfile(os.path.join(plain, "model.safetensors"))
    assert_losses_close(losses(runs["fsdp_from_plain"]), losses(runs["ref"]), [3, 4])
    val, ref_val = read_metrics(str(runs["fsdp_from_plain"]), "val"), read_metrics(str(runs["ref"]), "val")
    assert [v["step"] for v in val] == [4], val
    assert abs(val[0]["val_loss"] - ref_val[-1]["val_loss"]) <= 1e-5 * ref_val[-1]["val_loss"]
    ckpt = str(runs["fsdp_from_plain"] / "checkpoints" / "step_00000004")
    assert is_sharded(ckpt) and json.load(open(os.path.join(ckpt, "state.json")))["world_size"] == 2


@cpu_only
def test_export_for_generation(runs, tmp_path):
    """export() writes each sharded checkpoint (DDP's and FSDP2's, saved on two ranks) as the folder
    generation loads, holding exactly the checkpoint's weights (read back by torch's own DCP converter).
    The two runs, the same training with its sums in another order, agree to fp32 rounding except where
    AdamW divides by a second moment near zero: there the rounding of a near-zero gradient moves the update
    by up to a step (optim.lr), so a few elements may differ by more (7 of 16384 in one w13 seen)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tritonllm.generate import load_for_generation

    states = []
    for name in ("ddp", "fsdp"):
        ckpt = str(runs[name] / "checkpoints" / "step_00000004")
        model, tokenizer = load_for_generation(export(ckpt, str(tmp_path / name)), torch.device("cpu"), torch.float32)
        assert tokenizer.vocab_size == model.cfg.vocab_size
        dcp_to_torch_save(ckpt, str(tmp_path / f"{name}.pt"))
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=False)["model"]
        state = model.state_dict()
        assert saved and set(saved) <= set(state), sorted(set(saved) - set(state))
        for key, value in saved.items():
            assert torch.equal(state[key], value.float()), key
        states.append(state)
    lr = float(next(o for o in TINY if o.startswith("optim.lr=")).split("=")[1])
    for key, a in states[0].items():
        diff = (a - states[1][key]).abs()
        assert diff.max() <= lr and (diff > 1e-5).float().mean() <= 0.005, (key, diff.max().item())


@cpu_only
def test_muon_under_ddp_and_fsdp_matches_one_process(runs):
    """optim=muon on two ranks: DDP (full gradients, nothing special) and FSDP2 (each block matrix
    orthogonalised whole from its gathered gradient and momentum shards) follow one Muon process with
    the global batch; FSDP2's checkpoints (momentum sharded like the weights) resume in one plain
    process, and the plain run's single-process checkpoint resumes on two FSDP2 ranks."""
    ref = losses(runs["muon_ref"])
    assert len(ref) == 3 and ref[3] < ref[1]
    for name in ("muon_ddp", "muon_fsdp"):
        assert_losses_close(losses(runs[name]), ref, [1, 2, 3])
        val, ref_val = read_metrics(str(runs[name]), "val"), read_metrics(str(runs["muon_ref"]), "val")
        assert [v["step"] for v in val] == [2, 3]
        assert all(abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"] for a, b in zip(val, ref_val))
        assert read_metrics(str(runs[name]), "train")[0]["tokens"] == 4 * 32
    assert_losses_close(losses(runs["muon_plain_from2"]), ref, [3])
    assert_losses_close(losses(runs["muon_fsdp_from_plain"]), ref, [3])


@cpu_only
def test_fp8_under_ddp_and_fsdp_matches_one_process(runs):
    """trainer.precision=fp8 under DDP and FSDP2 (the all-gathered bf16 weights quantized by each rank): the
    first loss is the one process's (rows quantize alike), the later ones differ only by the per-column
    quantization of each rank's micro-batch of 2 sequences where the one process's holds 4."""
    ref = losses(runs["fp8_ref"])
    assert sorted(ref) == [1, 2, 3] and ref[3] < ref[1]
    for name in ("fp8_ddp", "fp8_fsdp"):
        got = losses(runs[name])
        assert sorted(got) == [1, 2, 3] and abs(got[1] - ref[1]) <= 1e-5 * ref[1], (name, got, ref)
        assert all(abs(got[s] - ref[s]) <= 5e-3 * ref[s] for s in (2, 3)), (name, got, ref)


@cpu_only
def test_muon_on_shards_equals_muon_on_full_matrices(tmp_path):
    """Muon on DTensors sharded over two ranks (FSDP2's Shard(0)) against Muon on the full tensors:
    rows split unevenly or not at all on one rank (1 x 9), stacked experts split whole (3 and 1 of
    them), NorMuon's second moment, several gather chunks. The same kernels on the same full
    matrices: equal bit for bit. A Partial DTensor is refused, naming params."""
    out = tmp_path / "muon.json"
    r = torchrun(str(out), tmp_path, worker=os.path.join(ROOT, "tests", "_muon_shard_worker.py"), timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    result = json.loads(out.read_text())
    rows = {tuple(p["shape"]): p["local_rows"] for p in result["params"]}
    assert rows[(1, 9)] == [1, 0] and rows[(3, 4, 6)] == [2, 1] and rows[(7, 8)] == [4, 3], rows
    for p in result["params"]:
        assert p["moved"] > 0, p
        assert p["weight"] == 0.0 and p["momentum"] == 0.0 and p["second_moment"] in (None, 0.0), p
    assert [p["second_moment"] is not None for p in result["params"]].count(True) == 3
    assert result["partial_error"].startswith("params: Muon takes DTensors sharded on a 1-D mesh"), result


@cpu_only
def test_two_agents_join_through_a_localhost_rendezvous(runs, data_overrides, tmp_path):
    """The multi-node launch of the README and examples/slurm_train.sbatch on one host: two torchrun
    agents of one process each (--nnodes=2, a c10d rendezvous on localhost; the first to bind the
    endpoint hosts the store, the other joins as a client) running ``python -m tritonllm.train``
    with FSDP2 on gloo. Both ranks train and save their shards, the global batch is logged, and the
    losses of the two steps are those of one process with the global batch (the first update's
    learning rate does not depend on trainer.max_steps)."""
    port, run = free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=localhost:{port}", f"--rdzv_id=test-{port}", "-m", "tritonllm.train",
           *TINY, *data_overrides, *TWO, "trainer.max_steps=2", "trainer.parallel=fsdp", f"hydra.run.dir={run}"]
    results = run_agents([cmd, cmd], tmp_path, 240, child_env(OMP_NUM_THREADS="1", TRITONLLM_NO_AUTOTUNE="1"))
    logs = [r.stdout + r.stderr for r in results]
    assert [r.returncode for r in results] == [0, 0], "\n-----\n".join(log[-3000:] for log in logs)
    for log in logs:  # one rank per agent; each logs the global batch
        assert "256 tokens per step (2 ranks x 2 x 32 x 2 micro-batches, parallel=fsdp)" in log, log[-3000:]
        assert "FSDP2 over 2 ranks (gloo)" in log and "done: validation loss" in log, log[-3000:]
    ckpt = run / "checkpoints" / "step_00000002"
    assert is_sharded(str(ckpt)) and json.load(open(ckpt / "state.json"))["world_size"] == 2
    assert {f for f in os.listdir(ckpt) if f.startswith("rng_rank")} == {"rng_rank0.pt", "rng_rank1.pt"}
    assert [r["tokens"] for r in read_metrics(str(run), "train")] == [256, 512]
    assert_losses_close(losses(run), losses(runs["ref"]), [1, 2])


@cpu_only
def test_one_failing_rank_ends_every_rank(data_overrides, tmp_path):
    start = time.monotonic()
    r = torchrun({"runs": [[*TINY, *data_overrides, *TWO, "trainer.parallel=ddp", f"out_dir={tmp_path / 'run'}"]],
                  "fail": {"rank": 1, "after": 1}}, tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode != 0 and elapsed < 60, elapsed
    assert "tritonllm: error on rank 1: injected failure: batch 2 is unreadable" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loader_shares_are_disjoint_and_form_the_global_batch(world):
    stream = TokenStream([np.arange(23 * 8 + 1, dtype=np.uint16)])  # 23 windows of 8: epochs wrap mid-batch
    whole = TokenLoader(stream, 2 * world, 8, seed=5)
    shares = [TokenLoader(stream, 2, 8, seed=5, rank=r, world_size=world) for r in range(world)]
    for _ in range(30):
        x, y = whole.next_batch()
        parts = [s.next_batch() for s in shares]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert len({tuple(row.tolist()) for p in parts for row in p[0]}) == 2 * world or whole.n_windows < 2 * world
        assert all(s.state_dict() == whole.state_dict() for s in shares)
    val = [list(s.batches(3)) for s in shares]
    for b, (x, _) in enumerate(whole.batches(3)):
        assert torch.equal(torch.cat([v[b][0] for v in val]), x)
    with pytest.raises(ValueError, match="rank must be in"):
        TokenLoader(stream, 2, 8, seed=5, rank=world, world_size=world)


def test_clip_norm_reduced_over_holders(device):
    """Two holders of halves of the gradients, each adding the other's sum of squares in ``reduce``:
    both clip by the norm of the whole, as one holder of everything does."""
    grads = [torch.randn(n, device=device) * 3 for n in (5, 300, 1, 64)]
    whole = [g.clone() for g in grads]
    norm = clip_grads_(whole, 1.0)
    halves = [[g.clone() for g in grads[:2]], [g.clone() for g in grads[2:]]]
    sq = [sum(float(g.double().square().sum()) for g in h) for h in halves]
    for i, half in enumerate(halves):
        got = clip_grads_(half, 1.0, reduce=lambda t, other=sq[1 - i]: t.add_(other))
        torch.testing.assert_close(got, norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.cat([*halves[0], *halves[1]]), torch.cat(whole), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="grads is empty"):
        clip_grads_([], 1.0, reduce=lambda t: t)


def test_adamw_counts_the_step_of_an_empty_shard(device):
    """A rank's FSDP2 shard of a small parameter can be empty: its step count still advances."""
    params = [torch.empty(0, device=device), torch.randn(7, device=device)]
    grads = [torch.empty(0, device=device), torch.randn(7, device=device)]
    steps = [torch.zeros((), device=device) for _ in params]
    before = params[1].clone()
    adamw_step_(params, grads, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params],
                steps=steps, lr=0.1)
    assert [float(s) for s in steps] == [1.0, 1.0] and not torch.equal(params[1], before)
    only_empty = [torch.zeros((), device=device)]
    adamw_step_([torch.empty(0, device=device)], [torch.empty(0, device=device)], [torch.empty(0, device=device)],
                [torch.empty(0, device=device)], steps=only_empty, lr=0.1)
    assert float(only_empty[0]) == 1.0


@pytest.mark.parametrize("grid, persistent, dynamic",
                         [("dynamic", False, True), ("tile", False, False), ("persistent", True, False)])
def test_gemm_grid_beside_nccl(grid, persistent, dynamic, kernel_settings):
    """Under DDP or FSDP2 on GPUs the WS GEMM takes dynamic tiles and the other GEMM kernels run one
    program per tile unless trainer.gemm_grid asks for another grid, leaving no SMs to NCCL unless
    trainer.gemm_sm_margin says how many; anything else is refused, naming the key."""
    from tritonllm.kernels import configure_gemm, gemm_settings
    from tritonllm.train.parallel import gemm_grid_beside_nccl

    configure_gemm(persistent=not persistent, dynamic=not dynamic, sm_margin=3)
    assert gemm_grid_beside_nccl(grid) == grid
    assert (gemm_settings().persistent, gemm_settings().dynamic, gemm_settings().sm_margin) == (persistent, dynamic, 0)
    gemm_grid_beside_nccl(grid, 16)
    assert gemm_settings().sm_margin == 16
    for bad in (-4, "sixteen", True):
        with pytest.raises(ConfigError, match="trainer.gemm_sm_margin"):
            gemm_grid_beside_nccl(grid, bad)
    with pytest.raises(ConfigError, match="trainer.gemm_grid"):
        gemm_grid_beside_nccl("static")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_two_ranks(data_overrides, tmp_path):
    """NCCL, bf16, two GPUs: DDP with the step captured in a CUDA graph (after 11 eager steps) and
    FSDP2 (eager) follow the one-GPU graphed run of the global batch within bf16 rounding; so does
    FSDP2 with optim=muon (bf16 iterations on the gathered matrices) the one-GPU Muon run."""
    gpu = [*TINY, *data_overrides, "device=cuda", "trainer.max_steps=14", "trainer.eval_interval=14",
           "trainer.ckpt_interval=7", "trainer.grad_accum=2"]
    train(compose_train(*gpu, "trainer.batch_size=4", f"out_dir={tmp_path / 'ref'}"))
    train(compose_train(*gpu, "trainer.batch_size=4", "optim=muon", f"out_dir={tmp_path / 'muon_ref'}"))
    r = torchrun({"backend": "nccl", "runs": [
        [*gpu, "trainer.batch_size=2", "trainer.parallel=ddp", f"out_dir={tmp_path / 'ddp'}"],
        [*gpu, "trainer.batch_size=2", "trainer.parallel=fsdp", f"out_dir={tmp_path / 'fsdp'}"],
        [*gpu, "trainer.batch_size=2", "trainer.parallel=fsdp", "optim=muon", f"out_dir={tmp_path / 'muon'}"]]},
        tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "training step captured in a CUDA graph after 11 eager warm-up steps" in r.stderr, r.stderr[-3000:]
    assert "the training step runs eagerly" in r.stderr
    assert "GEMM grid beside NCCL (NCCL's kernels share the SMs): the WS kernel's tiles from a global counter" in r.stderr
    for name, ref in (("ddp", "ref"), ("fsdp", "ref"), ("muon", "muon_ref")):
        want, got = losses(tmp_path / ref), losses(tmp_path / name)
        assert sorted(got) == list(range(1, 15))
        assert abs(got[1] - want[1]) <= 2e-3 * want[1], (name, got[1], want[1])
        assert all(abs(got[s] - want[s]) <= 3e-2 * want[s] for s in got), (name, got, want)
        assert is_sharded(str(tmp_path / name / "checkpoints" / "step_00000014"))
