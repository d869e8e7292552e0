#!/usr/bin/env bash
# Multi-GPU session (2 GPUs, e.g. nvidia-h200-x2), under 9 minutes: install (as scripts/gpu_run.sh),
# the GPU tests of tests/test_parallel.py, then void1b (MODEL) throughput through torchrun on 1 and 2
# GPUs: tritonllm DDP (CUDA-graphed step) and FSDP2 (eager), and the plain-PyTorch baseline
# (tritonllm.bench.baseline_model, torch.compile per block) with FSDP2, side by side (6 runs of at most
# RUN_TIMEOUT=65 s; scripts/dist_bench.py --side baseline --parallel ddp gives the DDP baseline).
# Rows: $OUT/dist-<model>.jsonl (one per run); summary with scaling efficiency: $OUT/dist-<model>.json.
# Usage: scripts/gpu_multi.sh [tests] [bench]   (default: both)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
MODEL=${MODEL:-void1b}
mkdir -p "$OUT"
if [ -d .whl ]; then  # wheels carried to a machine without network: hydra, omegaconf, antlr4, liger-kernel
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
for stage in ${*:-tests bench}; do
    case $stage in
        tests)
            timeout -s INT -k 15 ${TEST_TIMEOUT:-90} python3 -m pytest -q -rfE --tb=short tests/test_parallel.py -p no:cacheprovider \
                --junitxml="$OUT/tests-parallel.xml" > "$OUT/tests-parallel.log" 2>&1; tail -15 "$OUT/tests-parallel.log" ;;
        bench)
            rm -f "$OUT/dist-$MODEL.jsonl"
            for n in 1 2; do
                [ "$n" -le "$NGPU" ] || continue
                for run in "tritonllm ddp" "tritonllm fsdp" "baseline fsdp"; do
                    set -- $run
                    echo "== $1 $2 on $n GPU(s)"
                    timeout -k 10 ${RUN_TIMEOUT:-65} torchrun --standalone --nproc_per_node=$n scripts/dist_bench.py \
                        --model "$MODEL" --side $1 --parallel $2 --out "$OUT" ${BENCH_ARGS:-} \
                        > "$OUT/dist-$MODEL-$1-$2-$n.log" 2>&1 || { echo "   failed or timed out:"; tail -4 "$OUT/dist-$MODEL-$1-$2-$n.log"; }
                    grep '^{' "$OUT/dist-$MODEL-$1-$2-$n.log" | tail -1
                done
            done
            python3 - "$OUT/dist-$MODEL.jsonl" "$OUT/dist-$MODEL.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
one = {(r["side"], r["parallel"]): r["tokens_per_s_per_gpu"] for r in rows if r["nproc"] == 1}
for r in rows:
    base = one.get((r["side"], r["parallel"]))
    r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base if base else None
best = {n: max((r["tokens_per_s"] for r in rows if r["side"] == "baseline" and r["nproc"] == n), default=None) for n in (1, 2)}
for r in rows:
    if r["side"] == "tritonllm" and best.get(r["nproc"]):
        r["speedup_vs_best_baseline"] = r["tokens_per_s"] / best[r["nproc"]]
json.dump({"results": rows}, open(sys.argv[2], "w"), indent=1)
for r in rows:
    print(f'{r["side"]:9s} {r["parallel"]:4s} x{r["nproc"]}: {r["tokens_per_s_per_gpu"]:9.0f} tok/s/GPU  '
          f'MFU {r["mfu_per_gpu"]:.3f}  peak {r["peak_mem_gb"]:.1f} GB  graph {r["cuda_graph"]}  '
          f'scaling {r["scaling_efficiency"] if r["scaling_efficiency"] is None else round(r["scaling_efficiency"], 3)}')
PY
            ;;
    esac
done
