"""``python -m tritonllm.train +model=<name> [overrides]``: pretrain a tritonllm model (see :mod:`tritonllm.train.loop`)."""

import hydra

from tritonllm.runtime import exit_on_user_error
from tritonllm.train.loop import train


@hydra.main(version_base="1.3", config_path="pkg://tritonllm.conf", config_name="train")
@exit_on_user_error
def main(cfg) -> float:
    return train(cfg)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()  # under torchrun, an error's rank and traceback reach torchrun's failure summary
