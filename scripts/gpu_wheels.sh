#!/usr/bin/env bash
# Download the wheels the device machine needs (it has torch and triton but no network) into .whl/
# (gitignored; pass it to the device tool with carry: [".whl"]). Core: hydra, omegaconf, antlr4,
# liger-kernel. .whl/extra: the test dependencies for CPython 3.12 on x86_64 that the device lacks or has older
# (what it has: torch, triton, numpy, matplotlib, accelerate, safetensors, sentencepiece, nvidia-ml-py, rich).
set -euo pipefail
PY=${PY:-python3}
mkdir -p .whl/extra
plat=(--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp --abi cp312)
$PY -m pip download -q --no-deps -d .whl hydra-core==1.3.2 omegaconf==2.3.0 liger-kernel
# torchao float8: the FP8 baseline of bench kernels (fp8_linear) and bench train (trainer.precision=fp8); 0.17 pairs with torch 2.11
$PY -m pip download -q --no-deps -d .whl/extra "${plat[@]}" --abi abi3 --abi none torchao==0.17.0
$PY -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
$PY -m pip download -q --no-deps -d .whl/extra hydra-optuna-sweeper  # hparams_search=optuna (make smoke-gpu)
$PY -m pip download -q -d .whl/extra "${plat[@]}" transformers tokenizers peft optuna matplotlib nvidia-ml-py \
    pytest pytest-xdist safetensors sentencepiece jinja2 accelerate
# torch, triton and what they pull in are on the device machine already
rm -f .whl/extra/{matplotlib,pillow,fonttools,contourpy,kiwisolver,cycler,pyparsing,hf_xet,pygments,rich,python_dateutil,accelerate,safetensors,sentencepiece,nvidia_ml_py,psutil}-* .whl/extra/sympy-* .whl/extra/mpmath-* .whl/extra/networkx-* .whl/extra/filelock-* .whl/extra/fsspec-* .whl/extra/typing_extensions-* .whl/extra/setuptools-* .whl/extra/jinja2-* .whl/extra/markupsafe-* .whl/extra/torch-* .whl/extra/triton-* .whl/extra/nvidia_*cu* .whl/extra/nvidia_nccl* .whl/extra/nvidia_nvshmem* .whl/extra/nvidia_cusparselt* .whl/extra/nvidia_nvjitlink* .whl/extra/nvidia_nvtx* .whl/extra/nvidia_cufile* .whl/extra/numpy-*
ls .whl .whl/extra | wc -l
