#!/usr/bin/env bash
# What a GPU run does on a machine with no package registry (the `device` box): install the carried
# wheels (nox, Liger-Kernel, ...; see ../shared/tools/device-wheels.sh), then run the nox sessions on the
# machine's own torch/triton with --no-venv. Usage: bash benchmarks/gpu_session.sh STEP... ; logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
SRC=packages/kp-core/src:packages/kp-norms/src:packages/kp-attention/src:conformance/src:benchmarks
status=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
          python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    tests) PYTHONPATH=$SRC:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider packages/kp-core/tests packages/kp-norms/tests packages/kp-attention/tests ;;
    tune) PYTHONPATH=$SRC:$PYTHONPATH python3 benchmarks/bench_norms.py --tune ;;
    tune-glu) PYTHONPATH=$SRC:$PYTHONPATH python3 benchmarks/bench_glu.py --tune ;;
    tune-attention) PYTHONPATH=$SRC:$PYTHONPATH python3 benchmarks/bench_attention.py --tune ;;
    bench-*) PYTHONPATH=$SRC:$PYTHONPATH python3 benchmarks/bench_${step#bench-}.py ;;
    conformance-*) KP_TIER=${step#conformance-} python3 -m nox --no-venv -s conformance -- -n 4 ;;
    bench) python3 -m nox --no-venv -s bench ;;
    demo) python3 -m nox --no-venv -s demo ;;
    *) echo "unknown step $step"; status=2 ;;
  esac 2>&1 | tee -a "$OUT/gpu_session.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && { echo "step $step failed: rc=$rc"; status=1; }
done
cp -r conformance/reports "$OUT/" 2>/dev/null
cp -r benchmarks/results "$OUT/" 2>/dev/null
exit $status
