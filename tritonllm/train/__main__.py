"""``python -m tritonllm.train +model=<name> [overrides]``: pretrain a tritonllm model (see :mod:`tritonllm.train.loop`)."""

from tritonllm.runtime import hydra_app
from tritonllm.train.loop import train


@hydra_app("train")
def main(cfg) -> float:
    return train(cfg)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()  # under torchrun, an error's rank and traceback reach torchrun's failure summary
