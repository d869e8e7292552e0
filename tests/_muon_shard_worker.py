"""One rank of tests/test_parallel.py::test_muon_on_shards_equals_muon_on_full_matrices, started by torchrun.

``python -m torch.distributed.run --nproc_per_node=2 tests/_muon_shard_worker.py <out.json>``: the same
parameters and gradients as plain tensors and as DTensors ``Shard(0)`` over the ranks (as FSDP2
shards them), two steps of :class:`tritonllm.optim.Muon` on each (one group Muon, one NorMuon, weight
decay; two iterations, which is all the comparison needs); rank 0 writes, per parameter, the largest
difference of the gathered weight, momentum buffer and second moment from the plain run's, the sizes
of each rank's shards, and the error a Partial DTensor raises.
"""

import json
import os
import sys

os.environ.setdefault("TRITONLLM_NO_AUTOTUNE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor  # noqa: E402

import tritonllm.kernels  # noqa: E402,F401  (the interpreter on a machine without a GPU)
import tritonllm.optim.muon as muon  # noqa: E402

#: wide, tall, one row (rank 1 holds none of it), 3 experts (2 + 1), 1 expert (rank 1 holds none), 7 rows (4 + 3)
SHAPES = [(5, 7), (17, 3), (1, 9), (3, 4, 6), (1, 6, 5), (7, 8)]
NORMUON = [0, 3, 5]  # indices of the NorMuon group's parameters


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    muon.GATHER_ELEMENTS = 40  # the gathered matrices go through the kernels in several chunks
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
    shard = lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])  # noqa: E731
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    sharded = [torch.nn.Parameter(shard(w)) for w in weights]

    def optimizer(params):
        groups = [{"params": [p for i, p in enumerate(params) if i in NORMUON], "normuon": True},
                  {"params": [p for i, p in enumerate(params) if i not in NORMUON]}]
        return muon.Muon(groups, lr=0.05, weight_decay=0.1, ns_steps=2, work_dtype=torch.float32)

    opt_plain, opt_sharded = optimizer(plain), optimizer(sharded)
    for step_grads in grads:
        for p, q, g in zip(plain, sharded, step_grads):
            p.grad, q.grad = g.clone(), shard(g)
        opt_plain.step()
        opt_sharded.step()
    diff = lambda a, b: float((full(a) - b).abs().max()) if b.numel() else 0.0  # noqa: E731
    result = {"params": [], "partial_error": None}
    for i, (p, q) in enumerate(zip(plain, sharded)):
        sp, sq = opt_plain.state[p], opt_sharded.state[q]
        sizes = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, q.to_local().shape[0])
        result["params"].append({
            "shape": list(SHAPES[i]), "local_rows": sizes, "weight": diff(q.detach(), p.detach()),
            "momentum": diff(sq["momentum_buffer"], sp["momentum_buffer"]),
            "second_moment": diff(sq["second_moment"], sp["second_moment"]) if i in NORMUON else None,
            "moved": float((p.detach() - weights[i]).abs().max()) if p.numel() else 0.0})
    bad = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
    bad.grad = DTensor.from_local(torch.randn(4, 4), mesh, [Partial()])
    try:
        muon.Muon([bad], work_dtype=torch.float32).step()
    except ValueError as e:
        result["partial_error"] = str(e)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
