#!/usr/bin/env bash
# Device check of the NVML backend on a machine with a real NVIDIA GPU (no Kafka needed):
#   1. one NodeTick from `--backend nvml --once --print`, validated against the wire model;
#   2. 20 back-to-back ticks timed: CPU ms and NVML calls per tick (the agent's cost);
#   3. the NVML unit tests (fake pynvml) for good measure;
#   4. with GPULEDGER_DEVICE_BENCH=1, the join benchmark (`bench.run --only join`: one worker
#      against the raw consumer, two workers against one) on that machine's cores.
# Outputs go to $OUT (or ./device-check-out). A failed step does not stop the later ones (one
# device call should bring back everything); the exit status is non-zero if any step failed.
#
# Python: .venv if there is one, else $PYTHON or python3 with gpuledger installed. A lent device
# machine has Python 3.12 and no package index: carry the wheels the image lacks in .whl/ (the
# runtime dependencies in pyproject.toml that the image has not, downloaded for its Python and
# platform with `pip download --no-deps --only-binary=:all:`, plus clickhouse-connect for
# tests/conftest.py); they go to a private --target folder, and the package folders are laid out
# as setuptools' package-dir maps them (pyproject says Python 3.11, so no pip install there).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/device-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import gpuledger.agents.gpu_agent" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/gpuledger-device-site"; layout="${TMPDIR:-/tmp}/gpuledger-device-src"
    echo "installing the carried wheels to $site and laying out the sources in $layout" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
      >"$OUT/pip.log" 2>&1
    # the checkout mirrored by links, except gpuledger/, which gets the mapped folders inside it;
    # we run from the mirror, since Python puts the working directory first on its path
    rm -rf "$layout" && mkdir -p "$layout/gpuledger"
    for entry in * .git; do [[ "$entry" == gpuledger ]] || ln -s "$PWD/$entry" "$layout/$entry"; done
    cp -r gpuledger/. "$layout/gpuledger/"
    for pair in agents:agents streams:streams schemas:schemas sql:sql superset/bundle:superset_bundle; do
      ln -sfn "$PWD/${pair%%:*}" "$layout/gpuledger/${pair##*:}"
    done
    cd "$layout"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "installing gpuledger (pip install -e .)" >&2
    "$PY" -m pip install -q -e . >"$OUT/pip.log" 2>&1
  fi
fi
"$PY" -c "import sys, gpuledger.agents.gpu_agent; print('python', sys.version.split()[0])"

nvidia-smi --query-gpu=index,name,uuid,driver_version,power.draw,temperature.gpu --format=csv \
  >"$OUT/nvidia-smi.csv" 2>&1 || echo "nvidia-smi not available" >"$OUT/nvidia-smi.csv"

failed=()
step() {  # step NAME COMMAND...: run it, note a failure, go on
  local name="$1"; shift
  echo "== $name"
  if ! "$@"; then echo "   step '$name' FAILED"; failed+=("$name"); fi
}

one_tick() {
  "$PY" -m gpuledger.agents.gpu_agent --backend nvml --once --print --node "$(hostname)" --log-level INFO \
    >"$OUT/tick.json" 2>"$OUT/tick.log" || { tail -5 "$OUT/tick.log"; return 1; }
  "$PY" - "$OUT/tick.json" <<'PYEOF'
import sys
from gpuledger.schemas.models import NodeTick
from gpuledger.schemas.wire import decode
tick = decode(NodeTick, open(sys.argv[1], "rb").read().strip())
for g in tick.gpus:
    print(f"  gpu {g.index} {g.model} {g.gpu_uuid} health={g.health.value} util={g.util_gpu_pct}% "
          f"power={g.power_w}W energy={g.energy_j}J temp={g.temperature_c}C procs={len(g.processes)}")
PYEOF
}

twenty_ticks() {
  "$PY" -m gpuledger.agents.gpu_agent --backend nvml --bench 20 --log-level WARNING \
    >"$OUT/bench.json" 2>"$OUT/bench.log" || { tail -5 "$OUT/bench.log"; return 1; }
  cat "$OUT/bench.json"
}

unit_tests() {
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_nvml_backend.py tests/unit/test_gpu_agent.py \
    >"$OUT/pytest.log" 2>&1 && tail -1 "$OUT/pytest.log" || { tail -30 "$OUT/pytest.log"; return 1; }
}

join_bench() {
  echo "   on $(nproc) CPUs"
  "$PY" -m bench.run --only join --output "$OUT/results.json" >"$OUT/join.log" 2>&1
  local rc=$?
  grep -E "join|worker|baseline|ceiling|tick|pass" "$OUT/join.log" | grep -vE " -  " | tail -20
  return $rc
}

step "one tick" one_tick
step "20 ticks" twenty_ticks
step "unit tests" unit_tests
if [[ "${GPULEDGER_DEVICE_BENCH:-0}" == 1 ]]; then step "join benchmark" join_bench; fi
echo "outputs in $OUT"
if (( ${#failed[@]} )); then echo "FAILED steps: ${failed[*]}"; exit 1; fi
