#!/usr/bin/env bash
# What a GPU run does on a machine with no package registry: install the carried wheels (nox, Liger-Kernel, ...;
# fetched beforehand with `pip download` into .whl/), then run the steps on the machine's own torch/triton, with
# the packages' sources on PYTHONPATH. Usage: bash benchmarks/gpu_session.sh STEP...; logs go to $OUT.
# Steps: info, tests-PKG, conformance-TIER, conformance-TIER-a then conformance-TIER-b (the tier in two parts, one
# report: put part a's report back in conformance/reports/ before part b), spec-NAME (one spec file, KP_TIER or small), cpu, demo,
# tune-NAME, bench-NAME, fa-suite-BACKEND (FlashAttention's test file in .fa-suite/tests/, FA_ARGS: e.g.
# "--fa-sample 400") (WORKERS: pytest workers for tests-*, default 8). Each step has its own time limit (STEP_TIMEOUT seconds, default 540) so one hang cannot eat the run.
# spec-A+B runs several spec files in one pytest (one report; SPEC_K: a pytest -k expression). With .fa4b/ carried (../shared tools' device-fa4.sh,
# whose first half an earlier call on this machine left in /tmp/fa4), FlashAttention-4 is installed first and its
# compiled kernels are cached on disk for every worker and later call on the machine.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
if [ -f .fa4b/install.sh ]; then
  bash .fa4b/install.sh && export PYTHONPATH=$(cat /tmp/fa4site/PATHS):$PYTHONPATH
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
fi
SRC=$(ls -d packages/*/src | tr '\n' :)conformance/src:benchmarks
LIMIT=${STEP_TIMEOUT:-540}
# conformance-TIER-a runs these specs, conformance-TIER-b the rest (about half the small tier's time each).
PART_A="attention decode graphs guard mx registry sparsity tiers"
touch /tmp/session_start
status=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
          python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    tests-kp) PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider packages/kp/tests ;;
    tests-*) dir="packages/kp-${step#tests-}/tests"  # TESTS="test_a.py test_b.py": only those files
             PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" \
               $(if [ -n "${TESTS:-}" ]; then for f in $TESTS; do echo "$dir/$f"; done; else echo "$dir"; fi) ;;
    conformance-*-a|conformance-*-b)  # a tier in two calls: part a's report comes back and travels to part b
      tier=${step#conformance-}; part=${tier##*-}; tier=${tier%-*}
      files=$(for f in conformance/specs/test_*.py; do n=$(basename "$f" .py); n=${n#test_}
                case " $PART_A " in *" $n "*) [ "$part" = a ] && echo "$f";; *) [ "$part" = b ] && echo "$f";; esac
              done)
      if [ "$part" = a ]; then part_env=KP_CENSUS=defer; else part_env=KP_REPORT_RESUME=1; fi
      env "$part_env" PYTHONPATH=$SRC:$PYTHONPATH KP_TIER=$tier timeout "$LIMIT" python3 -m pytest -q \
        -p no:cacheprovider --rootdir . --durations=25 -n "${WORKERS:-8}" --dist load --maxschedchunk 1 $files ;;
    conformance-*) KP_WORKERS=${WORKERS:-16} KP_TIER=${step#conformance-} timeout "$LIMIT" \
                      python3 -m nox --no-venv -s conformance ;;
    spec-*) files=$(for n in $(echo "${step#spec-}" | tr + ' '); do echo "conformance/specs/test_$n.py"; done)
            PYTHONPATH=$SRC:$PYTHONPATH KP_TIER=${KP_TIER:-small} timeout "$LIMIT" python3 -m pytest -q \
              -p no:cacheprovider --rootdir . --durations=15 -n "${WORKERS:-8}" -k "${SPEC_K:-}" $files ;;
    fa-suite-*)  # FlashAttention's tests/test_flash_attn.py, carried in .fa-suite/tests/, against one backend
      PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 -m pytest .fa-suite/tests/test_flash_attn.py -q \
        -p kp_conformance.fa_suite -p no:cacheprovider --rootdir .fa-suite/tests \
        --fa-backend "${step#fa-suite-}" --fa-report "$OUT/fa-suite-${step#fa-suite-}.json" ${FA_ARGS:-} ;;
    cpu) PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 benchmarks/cpu_overhead.py ;;
    demo) PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 benchmarks/demo.py ;;
    tune-*) PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 "benchmarks/bench_${step#tune-}.py" --tune ;;
    bench-*) eval "args=(${BENCH_ARGS:-})"  # shell words: BENCH_ARGS='--only "kp.optimize + compile"' keeps its quotes
             PYTHONPATH=$SRC:$PYTHONPATH timeout "$LIMIT" python3 "benchmarks/bench_${step#bench-}.py" "${args[@]}" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac 2>&1 | tee -a "$OUT/gpu_session.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "step $step failed: rc=$rc"; status=1; }
done
# What this run wrote (the tool brings back at most 8 files): new conformance reports and benchmark results.
find conformance/reports benchmarks/results -type f -newer /tmp/session_start -exec cp {} "$OUT/" \;
exit $status
