# Sourced by scripts/gpu_run.sh and scripts/gpu_multi.sh (in the repository root, OUT set): the carried
# wheels and tritonllm itself (editable), each installed once per machine, so that calls chained on a
# warm machine skip them. The wheels are reinstalled only when they change: a reinstall would renew the
# files' mtimes, and with them the cache key of the packages corpus (data.packages=true), so a warm
# machine's next evolve call would tokenize again.
if [ -d .whl ]; then  # wheels carried (scripts/gpu_wheels.sh): hydra, omegaconf, antlr4, liger-kernel; .whl/extra: test deps
    wheels=$(md5sum .whl/*.whl .whl/extra/*.whl 2>/dev/null | md5sum)
    if [ "$(cat /tmp/site/.wheels 2>/dev/null)" = "$wheels" ] || \
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl/extra/*.whl 2>/dev/null); then
        echo "$wheels" > /tmp/site/.wheels
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
if [ ! -e /tmp/.tritonllm-installed ]; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
    rm -f "$OUT/install.log"
    touch /tmp/.tritonllm-installed
fi
