#!/usr/bin/env bash
# Multi-GPU session (nvidia-h200-x2, or more GPUs of one host), under 9 minutes per call: install
# (scripts/gpu_install.sh), then the stages asked for:
#   tests  tests/test_parallel.py on the GPUs (test_gpu_two_ranks: NCCL, DDP with the step in a CUDA
#          graph and FSDP2, against one GPU)
#   bench  python -m tritonllm.bench train --nproc $NPROC +model=$MODEL: tritonllm DDP and FSDP2
#          (PARALLEL) on NPROC GPUs (a comma-separated list of counts: the scaling curve) and
#          tritonllm on one, beside the plain-PyTorch baseline compiled per block then wrapped in
#          DDP / FSDP2 (torchtitan's order), on the same counts and on one; each configuration one
#          torchrun of at most RUN_TIMEOUT s (its output in $OUT/bench-workers.log), the whole bench
#          at most BENCH_TIMEOUT s. Rows (nproc, parallel, scaling_efficiency, baselines, speedup)
#          merge into $OUT/train-<gpu>.json, a copy of docs/perf/'s: copy it back into docs/perf/
#          (copies left unchanged are removed).
# Calls chained in one command share the install (scripts/gpu_install.sh: once per machine).
# TRITONLLM_COMMIT=<commit>: the commit result rows record (a lent machine's copy of the tree may carry stale
#   git metadata, which reads as an old commit, "-dirty").
# Usage: MODEL=void1b scripts/gpu_multi.sh [tests] [bench]            (default: both)
#        MODEL=void125m BENCH_ARGS="trainer.batch_size=16 trainer.seq_len=1024" scripts/gpu_multi.sh bench
#        MODEL=void3b PARALLEL=fsdp NPROC=2,4 BENCH_ARGS="trainer.batch_size=2" scripts/gpu_multi.sh bench
#        MODEL=void1b PARALLEL=fsdp NPROC=2 BENCH_ARGS="--no-one-gpu --rounds 4 --ab trainer.gemm_sm_margin=8" scripts/gpu_multi.sh bench
#          (a config setting against the default and the baseline, interleaved A B C / C B A over 4 rounds:
#          here the SMs our persistent GEMM grids leave to NCCL)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
MODEL=${MODEL:-void1b}
PARALLEL=${PARALLEL:-ddp,fsdp}
mkdir -p "$OUT"
# the recorded results, so that new rows merge into them (rows of the same model, batch, nproc and parallel are replaced)
for f in docs/perf/train-*.json; do [ -e "$OUT/$(basename "$f")" ] || cp "$f" "$OUT/"; done
. scripts/gpu_install.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
NPROC=${NPROC:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
for stage in ${*:-tests bench}; do
    case $stage in
        tests)
            timeout -s INT -k 15 ${TEST_TIMEOUT:-180} python3 -m pytest -q -rfE --tb=short tests/test_parallel.py -p no:cacheprovider \
                > "$OUT/tests-parallel.log" 2>&1; tail -15 "$OUT/tests-parallel.log" ;;
        bench)
            timeout -k 15 ${BENCH_TIMEOUT:-520} python3 -m tritonllm.bench train --nproc "$NPROC" --parallel "$PARALLEL" \
                --timeout ${RUN_TIMEOUT:-300} --out "$OUT" --log "$OUT/bench-workers.log" +model="$MODEL" ${BENCH_ARGS:-} 2>&1 \
                | tee -a "$OUT/bench-multi.log" ;;
    esac
done
for f in "$OUT"/train-*.json; do cmp -s "$f" "docs/perf/$(basename "$f")" && rm -f "$f"; done
