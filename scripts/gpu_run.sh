#!/usr/bin/env bash
# One batched GPU session: install, GPU tests, kernel benchmarks, training benchmark.
# Usage: scripts/gpu_run.sh [tests] [bench[=op,op]] [tune] [tunelinear] [memops] [sm90] [contention] [train] [trainab] [trainrun] [smoke] [parity] [finetune] [evolve]
#        (default: tests bench)
# memops: scripts/tune_memops.py's sections (MEMOPS, default fp8: the quantization's knobs at void1b's shapes)
# contention: scripts/sm_contention.py (CONTENTION_ARGS): our GEMM against cuBLAS with some SMs held
# sm90: the Gluon kernels' GPU tests (-k sm90: attention forward and backward, the WS GEMM; spread over the
#   workers test by test, not file by file: each case autotunes Gluon configs), then
#   scripts/attention_sm90.py (SM90_PARTS, default fwd,bwd; SM90_ARGS e.g. --no-errors) under SM90_TIMEOUT: a hung
#   barrier stops a part, not the stage; SM90_K narrows the tests (a pytest -k expression, default sm90)
# trainab: bench train's MODEL row of this tree (against AB_BASELINES, default reduce-overhead) and of the tree of
#   commit AB_BASE, in the same call: run `git archive $AB_BASE | tar x -C .ab/$AB_BASE` here first and carry .ab
#   (gitignored); the base's row (tritonllm only) goes to $OUT/ab-base/, its commit named by AB_BASE
# trainrun: python -m tritonllm.train on random-token shards (MODEL, TRAINRUN_ARGS), metrics.jsonl kept
# train: TRAIN_ARGS e.g. "--compiled --baselines compile" (the model under torch.compile beside eager)
# finetune: python -m tritonllm.bench finetune (FINETUNE_ARGS; default TinyLlama shape, B4 T2048, rank 16)
# evolve: python -m tritonllm.evolve from MODEL (EVOLVE_ARGS; default: 60 s a candidate on the Python corpus with the
#   installed packages, so that no candidate repeats its data) in evolve-run/ (gitignored, kept on a warm
#   machine): the same stage again resumes the search. The run folder without weights comes back as
#   $OUT/evolve-run.tar.gz; put it in .evolve-state/ (gitignored) and carry that folder, and a fresh machine
#   resumes from it (children whose parent's weights are gone start cold)
# STACKS_EVERY=s: every s seconds each tritonllm process prints its Python stacks into the stage's log
#   (TRITONLLM_STACKS_EVERY, tritonllm.runtime.stacks_on_signal): where a slow warm-up spends its time.
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-out.
# TRITONLLM_COMMIT=<commit>: the commit result rows record (a lent machine's copy of the tree may carry stale
#   git metadata, which reads as an old commit, "-dirty").
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# the recorded results, so that new rows merge into them (write_results replaces same-key rows)
for f in docs/perf/*-*.json; do [ -e "$OUT/$(basename "$f")" ] || cp "$f" "$OUT/"; done
. scripts/gpu_install.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
stages=${*:-tests bench}
[ "${STACKS_EVERY:-0}" -gt 0 ] && export TRITONLLM_STACKS_EVERY=$STACKS_EVERY
for stage in $stages; do
    case $stage in
        tests)  # TEST_SHARD=i/n: every n-th test file from the i-th (0-based): the full suite in n calls of < 10 min;
                # PYTEST_ARGS: more pytest options (-v names every test and its worker); TEST_DIST=load spreads
                # one file's tests over the workers; TEST_WORKERS (default 8; the whole suite takes about 9 minutes
                # with 12 on an H200)
            files=${TESTS:-tests}
            if [ -n "${TEST_SHARD:-}" ]; then
                files=$(LC_ALL=C ls tests/test_*.py | awk -v i="${TEST_SHARD%/*}" -v n="${TEST_SHARD#*/}" '(NR - 1) % n == i')
            fi
            timeout -s INT -k 30 ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=line -n ${TEST_WORKERS:-8} --dist ${TEST_DIST:-loadfile} ${PYTEST_ARGS:-} $files -p no:cacheprovider \
                > "$OUT/tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|/tests/.*Error" "$OUT/tests.log" | head -60 ;;
        bench|bench=*)
            ops=${stage#bench}; ops=${ops#=}
            timeout ${BENCH_TIMEOUT:-540} python3 -m tritonllm.bench kernels ${ops:+--ops $ops} ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^--" | tail -${TAIL:-80} ;;
        tune)  # scripts/tune_attention.py (TUNE_ARGS, e.g. "--shapes causal64 --kernels fused")
            timeout ${TUNE_TIMEOUT:-300} python3 scripts/tune_attention.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | tail -${TAIL:-80} ;;
        tunelinear)  # scripts/tune_linear.py's sections (TUNE_LINEAR, default "splits swiglu"; TUNE_BUDGET_S for them)
            timeout ${TUNE_TIMEOUT:-330} python3 scripts/tune_linear.py ${TUNE_LINEAR:-splits swiglu} 2>&1 \
                | tee "$OUT/tune-linear.log" | tail -${TAIL:-80} ;;
        memops)
            timeout ${TUNE_TIMEOUT:-240} python3 scripts/tune_memops.py --ops ${MEMOPS:-fp8} --budget ${TUNE_BUDGET_S:-200} 2>&1 \
                | tee "$OUT/tune-memops.log" | tail -${TAIL:-120} ;;
        sm90)
            timeout -s INT -k 30 ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=short -n 8 --dist load -k "${SM90_K:-sm90}" \
                tests/test_flash_attention.py tests/test_linear.py -p no:cacheprovider > "$OUT/tests-sm90.log" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests-sm90.log" | head -40
            for part in $(echo ${SM90_PARTS:-fwd,bwd} | tr , ' '); do
                timeout ${SM90_TIMEOUT:-240} python3 scripts/attention_sm90.py --parts $part ${SM90_ARGS:-} > "$OUT/attention-sm90-$part.log" 2>&1
                echo "attention_sm90 --parts $part: rc $?"; grep -v "^{'case'" "$OUT/attention-sm90-$part.log" | tail -${TAIL:-12}
                [ -f "$OUT/attention-sm90.json" ] && mv "$OUT/attention-sm90.json" "$OUT/attention-sm90-$part.json"
            done ;;
        contention)
            timeout ${CONTENTION_TIMEOUT:-240} python3 scripts/sm_contention.py ${CONTENTION_ARGS:-} 2>&1 | tee "$OUT/contention.log" ;;
        train)
            timeout ${TRAIN_TIMEOUT:-400} python3 -m tritonllm.bench train +model=${MODEL:-void125m} --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" ;;
        trainab)
            [ -d ".ab/${AB_BASE:?AB_BASE: the commit to compare with}" ] || { echo "trainab: .ab/$AB_BASE missing (not carried?)"; exit 1; }
            timeout ${TRAIN_TIMEOUT:-300} python3 -m tritonllm.bench train +model=${MODEL:-void125m} --out "$OUT" \
                --baselines ${AB_BASELINES:-reduce-overhead} ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1; tail -${TAIL:-12} "$OUT/train.log"
            mkdir -p "$OUT/ab-base"; rm -rf /tmp/ab-site
            python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ab-site ".ab/$AB_BASE" > "$OUT/train-base.log" 2>&1
            (cd /tmp && PYTHONPATH=/tmp/ab-site${PYTHONPATH:+:$PYTHONPATH} TRITONLLM_COMMIT=$AB_BASE timeout ${TRAIN_TIMEOUT:-300} \
                python3 -c "import sys, runpy, tritonllm.kernels as k; print('base tree:', k.__file__); sys.argv[0] = 'tritonllm.bench'; runpy.run_module('tritonllm.bench', run_name='__main__', alter_sys=True)" \
                train +model=${MODEL:-void125m} --out "$(realpath "$OUT")/ab-base" --no-baseline ${TRAIN_ARGS:-}) >> "$OUT/train-base.log" 2>&1
            tail -${TAIL:-12} "$OUT/train-base.log" ;;
        trainrun)
            python3 -c "import numpy as np; from tritonllm.data.shards import write_shard; rng = np.random.default_rng(0); write_shard('/tmp/rand_train.bin', rng.integers(0, 32000, 4_000_000), 32000); write_shard('/tmp/rand_val.bin', rng.integers(0, 32000, 200_000), 32000)"
            timeout ${TRAINRUN_TIMEOUT:-300} python3 -m tritonllm.train +model=${MODEL:-void125m} data=bin data.files=/tmp/rand_train.bin \
                data.val_files=/tmp/rand_val.bin data.vocab_size=32000 trainer.max_steps=80 trainer.log_interval=20 \
                trainer.eval_interval=1000 trainer.eval_batches=2 trainer.ckpt_interval=null trainer.progress=false \
                hydra.run.dir=/tmp/trainrun ${TRAINRUN_ARGS:-} > "$OUT/trainrun.log" 2>&1
            grep -E "captured|graph|error|Error" "$OUT/trainrun.log" | head; grep '"kind": "train"' /tmp/trainrun/metrics.jsonl ;;
        smoke)  # make smoke-gpu: every README command at the smallest sizes (SMOKE_ONLY: case names); logs as one archive
            timeout ${SMOKE_TIMEOUT:-560} python3 scripts/smoke_gpu.py --out "$OUT" ${SMOKE_ONLY:+--only $SMOKE_ONLY} 2>&1 \
                | tee "$OUT/smoke.log" | tail -${TAIL:-40}
            tar czf "$OUT/smoke-logs.tar.gz" -C "$OUT" smoke-logs && rm -rf "$OUT/smoke-logs" ;;
        parity)  # scripts/fp8_parity.py: MODEL trained PARITY_STEPS steps in bf16 and in fp8 on PARITY_DATA, curves compared
            timeout ${PARITY_TIMEOUT:-560} python3 scripts/fp8_parity.py --model ${MODEL:-void125m} --steps ${PARITY_STEPS:-2000} \
                --out "$OUT" -- ${PARITY_DATA:-data=stdlib data.packages=true data.max_bytes=300000000 data.tokenizer_bytes=20000000} \
                2>&1 | tee "$OUT/parity.log" | tail -${TAIL:-20} ;;
        finetune)
            timeout ${FINETUNE_TIMEOUT:-500} python3 -m tritonllm.bench finetune ${FINETUNE_ARGS:---config tinyllama --batch 4 --seq-len 2048 --rank 16 --steps 10 --warmup 3} \
                --out "$OUT" 2>&1 | tee "$OUT/finetune.log" | tail -${TAIL:-40} ;;
        evolve)  # a fresh machine resumes from the carried state of the last call (.evolve-state, without weights)
            [ -d evolve-run ] || [ ! -f .evolve-state/evolve-run.tar.gz ] || tar xzf .evolve-state/evolve-run.tar.gz
            timeout -s INT -k 30 ${EVOLVE_TIMEOUT:-540} python3 -m tritonllm.evolve +model=${MODEL:-void125m} hydra.run.dir=evolve-run \
                ${EVOLVE_ARGS:-evolve.budget=60s evolve.population=4 evolve.generations=2 evolve.memory_cap_gb=40 evolve.warm_start=true trainer.batch_size=16 trainer.seq_len=1024 data.packages=true data.max_bytes=null data.tokenizer_bytes=20000000} \
                > "$OUT/evolve.log" 2>&1; tail -${TAIL:-40} "$OUT/evolve.log"
            tar czf "$OUT/evolve-run.tar.gz" --exclude='*.safetensors' --exclude='*.pt' evolve-run && ls -l "$OUT/evolve-run.tar.gz" ;;
    esac
done
# the device tool brings back at most 8 files: drop the recorded results no stage changed, and an empty install log
for f in docs/perf/*-*.json; do cmp -s "$f" "$OUT/$(basename "$f")" && rm "$OUT/$(basename "$f")"; done
[ -s "$OUT/install.log" ] || rm -f "$OUT/install.log"
