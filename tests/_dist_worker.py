"""One rank of the multi-process training tests (tests/test_parallel.py), started by torchrun.

``python -m torch.distributed.run --nproc_per_node=N tests/_dist_worker.py <spec.json>``: the spec
is ``{"runs": [[override, ...], ...], "fail": {"rank": r, "after": k} | null, "backend": "gloo" | "nccl"}``;
every run is one ``train(cfg)`` over the same process group (gloo by default), in order. With ``fail``, rank ``r``'s loader raises
a DataError at its ``k``-th training batch (the message names it), as bad data would.
"""

import json
import logging
import os
import sys

os.environ.setdefault("TRITONLLM_NO_AUTOTUNE", "1")

import tritonllm.kernels  # noqa: E402,F401  (the interpreter on a machine without a GPU)
from hydra import compose, initialize_config_module  # noqa: E402

from tritonllm.data.loader import TokenLoader  # noqa: E402
from tritonllm.errors import DataError  # noqa: E402
from tritonllm.runtime import exit_on_user_error  # noqa: E402
from tritonllm.train import train  # noqa: E402


def inject_failure(rank: int, after: int) -> None:
    if int(os.environ["RANK"]) != rank:
        return
    next_batch, calls = TokenLoader.next_batch, [0]

    def failing(self):
        calls[0] += 1
        if calls[0] > after:
            raise DataError(f"injected failure: batch {calls[0]} is unreadable")
        return next_batch(self)

    TokenLoader.next_batch = failing


@exit_on_user_error
def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("fail"):
        inject_failure(spec["fail"]["rank"], spec["fail"]["after"])
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    backend = spec.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)  # shared by every run below (train() uses an existing group)
    for overrides in spec["runs"]:
        with initialize_config_module("tritonllm.conf", version_base="1.3"):
            train(compose("train", overrides=overrides))
    dist.barrier()  # every rank done before any tears its connections down
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
