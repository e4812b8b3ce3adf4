#!/usr/bin/env bash
# GPU suite: every test (cuda-marked included), the benchmarks and the training example.
# Writes each step's log (tee'd), the benchmark JSON/PNG files and loss.png into ${OUT:-out}/.
#
# Sized for about 9 minutes on one H100 (L1_BUDGET_S, default 540 s): the fixed-cost steps run
# first (tests, bench_quantize, the training example), then bench_linear and bench_transformer
# share the time left through their soft --max-minutes budgets (a variant not started in time is
# listed as 'skipped' in their tables). By default a failing step does not stop the later ones;
# the script exits non-zero at the end if any step failed (KEEP_GOING=0: stop at the first).
#
# Knobs (environment):
#   OUT=out                 output directory
#   L1_BUDGET_S=540         total target, seconds
#   KEEP_GOING=1            run the later steps after a failure
#   L1_SKIP_TESTS=0         1: skip pytest
#   L1_SMOKE=0              1: tiny benchmark shapes and 3 training steps (checks the wiring; CPU ok)
#   PYTEST_TIMEOUT=0        hard limit for pytest in seconds (0: none)
#   PYTEST_ARGS="-m cuda or slow"   pytest selection ("" for every test)
#   PYTEST_WORKERS=         pytest-xdist workers (default: 3/4 of the CPU cores when xdist is installed, 0: none)
#   TRAIN_TIMEOUT=300       hard limit for the training example
#   L1_SKIP_TRAIN=0         1: skip the training example
#   LINEAR_SHAPES=          bench_linear --shapes (default: the script's shapes, docs/design.md's reference table)
#   LINEAR_RO_SHAPES=8192x8192x8192,2048x2048x2048,1024x2048x1024   also run under reduce-overhead ('' skips)
#   TRANSFORMER_SCOPE=layer bench_transformer --compile-scope (layer: 4x less to compile than model)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-out}"
L1_BUDGET_S="${L1_BUDGET_S:-540}"
KEEP_GOING="${KEEP_GOING:-1}"
L1_SKIP_TESTS="${L1_SKIP_TESTS:-0}"
L1_SMOKE="${L1_SMOKE:-0}"
PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-0}"
TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-300}"
LINEAR_SHAPES="${LINEAR_SHAPES:-}"
LINEAR_RO_SHAPES="${LINEAR_RO_SHAPES-8192x8192x8192,2048x2048x2048,1024x2048x1024}"
L1_SKIP_TRAIN="${L1_SKIP_TRAIN:-0}"
TRANSFORMER_SCOPE="${TRANSFORMER_SCOPE:-layer}"
PYTHON="${PYTHON:-python}"
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
SECONDS=0
FAILED=()
SUMMARY=()

# run_step NAME TIMEOUT_S CMD...: run CMD, tee its output into $OUT/NAME.log, record rc and time.
run_step() {
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS rc=0
    echo
    echo "=== [$name] $* (t=${SECONDS}s)"
    set +e
    if [ "$limit" -gt 0 ] 2>/dev/null; then
        timeout -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    else
        "$@" 2>&1 | tee "$OUT/$name.log"
    fi
    rc=${PIPESTATUS[0]}
    set -e
    local took=$((SECONDS - start))
    [ "$rc" -eq 124 ] && echo "=== [$name] hit its hard time limit (${limit}s)" | tee -a "$OUT/$name.log"
    echo "=== [$name] rc=$rc in ${took}s"
    SUMMARY+=("$(printf '%-22s rc=%-4s %5ss' "$name" "$rc" "$took")")
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name")
        if [ "$KEEP_GOING" != "1" ]; then
            finish
        fi
    fi
}

finish() {
    echo
    echo "=== L1 summary (total ${SECONDS}s, target ${L1_BUDGET_S}s; logs and results in $OUT/)"
    for line in "${SUMMARY[@]}"; do echo "  $line"; done
    if [ "${#FAILED[@]}" -gt 0 ]; then
        echo "FAILED: ${FAILED[*]}"
        exit 1
    fi
    echo "all steps passed"
    exit 0
}

# minutes (float) = max(min_s, share * (budget - elapsed - reserve_s)) / 60
minutes_left() {
    local share="$1" min_s="$2" reserve_s="$3"
    awk -v b="$L1_BUDGET_S" -v e="$SECONDS" -v s="$share" -v m="$min_s" -v r="$reserve_s" \
        'BEGIN { t = s * (b - e - r); if (t < m) t = m; printf "%.2f", t / 60 }'
}

"$PYTHON" - <<'EOF' | tee "$OUT/env.log"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
from importlib import metadata
for mod, dist in (("triton", "triton"), ("torchao", "torchao"), ("hypothesis", "hypothesis"),
                  ("matplotlib", "matplotlib"), ("nvdlfw_inspect", "nvdlfw-inspect")):
    try:
        __import__(mod)
        print(mod, metadata.version(dist))
    except Exception as e:
        print(mod, "not importable:", type(e).__name__, e)
EOF

SMOKE=()
TRAIN_STEPS=30
if [ "$L1_SMOKE" = "1" ]; then
    SMOKE=(--smoke)
    TRAIN_STEPS=3
fi

# 1. tests: the cuda- and slow-marked ones by default (the CPU suite is what CI runs; slow: CPU cases too
#    long for CI, such as inductor compiles of MXFP8 / NVFP4); PYTEST_ARGS="" runs all
if [ "$L1_SKIP_TESTS" != "1" ]; then
    read -r -a PARGS <<< "${PYTEST_ARGS-}"
    [ -z "${PYTEST_ARGS+x}" ] && PARGS=(-m "cuda or slow")
    WORKERS="${PYTEST_WORKERS:-}"
    if [ -z "$WORKERS" ]; then
        WORKERS=0
        "$PYTHON" -c "import xdist" 2>/dev/null && WORKERS=$(( $(nproc) * 3 / 4 ))
    fi
    [ "$WORKERS" -gt 1 ] && PARGS+=(-n "$WORKERS")
    run_step pytest "$PYTEST_TIMEOUT" env HYPOTHESIS_PROFILE=gpu "$PYTHON" -m pytest tests -q -p no:cacheprovider "${PARGS[@]}"
fi

# 2. quantize kernels (from another script; only when present)
if [ -f benchmarks/bench_quantize.py ]; then
    QARGS=()
    if "$PYTHON" benchmarks/bench_quantize.py --help 2>/dev/null | grep -q -- "--out"; then
        QARGS+=(--out "$OUT")
    fi
    if [ "$L1_SMOKE" = "1" ] && "$PYTHON" benchmarks/bench_quantize.py --help 2>/dev/null | grep -q -- "--smoke"; then
        QARGS+=(--smoke)
    fi
    run_step bench_quantize 180 "$PYTHON" benchmarks/bench_quantize.py "${QARGS[@]}"
else
    echo "=== [bench_quantize] benchmarks/bench_quantize.py not present: skipped"
    SUMMARY+=("$(printf '%-22s %s' bench_quantize 'not present')")
fi

# 3. the training example (fixed cost: runs before the soft-budgeted benchmarks)
if [ "$L1_SKIP_TRAIN" != "1" ]; then
    run_step train "$TRAIN_TIMEOUT" "$PYTHON" -m transformer_engine_proto.examples.train --compare \
        --steps "$TRAIN_STEPS" --quiet --plot "$OUT/loss.png"
fi

# 4. Linear fwd+bwd vs bf16 and torchao (compile default, all shapes), then reduce-overhead on the
#    small shapes where launch overhead matters; 5. distributed (>= 2 GPUs); 6. the HF Llama; 7. the TransformerLayer stack
LIN_ARGS=()
[ -n "$LINEAR_SHAPES" ] && LIN_ARGS+=(--shapes "$LINEAR_SHAPES")
min_lin=$(minutes_left 0.35 60 0)
run_step bench_linear $(( ${min_lin%.*} * 60 + 240 )) "$PYTHON" benchmarks/bench_linear.py "${SMOKE[@]}" \
    "${LIN_ARGS[@]}" --modes default --max-minutes "$min_lin" --out "$OUT" --name bench_linear

if [ -n "$LINEAR_RO_SHAPES" ] && [ "$L1_SMOKE" != "1" ]; then
    min_ro=$(minutes_left 0.2 45 0)
    run_step bench_linear_ro $(( ${min_ro%.*} * 60 + 180 )) "$PYTHON" benchmarks/bench_linear.py \
        --shapes "$LINEAR_RO_SHAPES" --modes reduce-overhead --max-minutes "$min_ro" --out "$OUT" --name bench_linear_ro
fi

# 5. FSDP2 / TP+SP: the distributed tests on NCCL, then all-gather bytes and step time, bf16 vs quantized (NCCL): only with >= 2 GPUs
DIST_TESTS=(tests/test_tensor_parallel.py tests/test_tp_amax_reduction.py tests/test_sp_quantized_gather.py
            tests/test_fsdp.py tests/test_debug_distributed.py)
NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    # the 2-process distributed tests again, with NCCL and one GPU per rank (CI runs them on gloo)
    run_step pytest_nccl "$PYTEST_TIMEOUT" env TE_PROTO_DIST_BACKEND=nccl HYPOTHESIS_PROFILE=gpu "$PYTHON" -m pytest \
        -q -p no:cacheprovider "${DIST_TESTS[@]}"
    min_dist=$(minutes_left 0.3 60 45)
    run_step bench_distributed $(( ${min_dist%.*} * 60 + 240 )) "$PYTHON" benchmarks/bench_distributed.py \
        "${SMOKE[@]}" --max-minutes "$min_dist" --out "$OUT" --name bench_distributed
else
    echo "=== [bench_distributed] needs >= 2 GPUs (found ${NGPU:-0}): skipped"
    SUMMARY+=("$(printf '%-22s %s' bench_distributed 'needs >= 2 GPUs')")
fi

# 6. a Hugging Face Llama with every Linear swapped (needs transformers; torchao when present)
if "$PYTHON" -c "import transformers" 2>/dev/null; then
    min_llama=$(minutes_left 0.4 90 45)
    run_step bench_llama $(( ${min_llama%.*} * 60 + 240 )) "$PYTHON" benchmarks/bench_llama.py "${SMOKE[@]}" \
        --max-minutes "$min_llama" --out "$OUT" --name bench_llama
else
    echo "=== [bench_llama] transformers not importable: skipped"
    SUMMARY+=("$(printf '%-22s %s' bench_llama 'no transformers')")
fi

min_tr=$(minutes_left 1.0 60 45)
run_step bench_transformer $(( ${min_tr%.*} * 60 + 240 )) "$PYTHON" benchmarks/bench_transformer.py "${SMOKE[@]}" \
    --compile-scope "$TRANSFORMER_SCOPE" --max-minutes "$min_tr" --out "$OUT" --name bench_transformer

finish
