"""Training: the loop (:mod:`.loop`, ``train(cfg)``), one optimizer step eager or CUDA-graphed
(:mod:`.step`, ``TrainStep``) and the ``python -m tritonllm.train`` entry point (``__main__``).

Multi-GPU training (process groups, DDP / FSDP2 wrapping) goes beside these as its own module,
applied to the model from outside: the model's code knows nothing of how it is distributed."""

from tritonllm.train.loop import (NonFiniteGuard, available_models, build_optimizer, evaluate, model_config,
                                  resume_candidates, train)
from tritonllm.train.step import MetricsQueue, StepOutput, TrainStep, resolve_cuda_graph

__all__ = ["MetricsQueue", "NonFiniteGuard", "StepOutput", "TrainStep", "available_models", "build_optimizer",
           "evaluate", "model_config", "resolve_cuda_graph", "resume_candidates", "train"]
