#!/usr/bin/env bash
# One batched GPU session: install, GPU tests, kernel benchmarks, training benchmark.
# Usage: scripts/gpu_run.sh [tests] [bench[=op,op]] [train]   (default: tests bench)
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# the recorded results, so that new rows merge into them (write_results replaces same-key rows)
for f in docs/perf/*-*.json; do [ -e "$OUT/$(basename "$f")" ] || cp "$f" "$OUT/"; done
if [ -d .whl ]; then  # wheels carried to a machine without network: hydra, omegaconf, antlr4, liger-kernel
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
stages=${*:-tests bench}
for stage in $stages; do
    case $stage in
        tests)
            timeout -s INT -k 30 ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=line -n 8 --dist loadfile ${TESTS:-tests} -p no:cacheprovider \
                --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|/tests/.*Error" "$OUT/tests.log" | head -60 ;;
        bench|bench=*)
            ops=${stage#bench}; ops=${ops#=}
            timeout ${BENCH_TIMEOUT:-540} python3 -m tritonllm.bench kernels ${ops:+--ops $ops} ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^--" | tail -${TAIL:-80} ;;
        train)
            timeout ${TRAIN_TIMEOUT:-400} python3 -m tritonllm.bench train +model=${MODEL:-void125m} --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" ;;
    esac
done
