"""The plain-PyTorch reference model of the tests: it lives in ``tritonllm.bench.reference_model``,
where the training benchmark uses it as its torch.compile baseline."""

from tritonllm.bench.reference_model import *  # noqa: F401,F403
