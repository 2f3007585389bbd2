#!/usr/bin/env bash
# Device check of the NVML backend on a machine with a real NVIDIA GPU (no Kafka needed):
#   1. one NodeTick from `--backend nvml --once --print`, validated against the wire model;
#   2. 20 back-to-back ticks timed: CPU ms and NVML calls per tick (the agent's cost);
#   3. the NVML unit tests (fake pynvml) for good measure.
# Outputs go to $OUT (or ./device-check-out). Exit status is non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/device-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import gpuledger.agents.gpu_agent" 2>/dev/null; then
  echo "installing gpuledger (pip install -e .)" >&2
  "$PY" -m pip install -q -e . >"$OUT/pip.log" 2>&1
fi

nvidia-smi --query-gpu=index,name,uuid,driver_version,power.draw,temperature.gpu --format=csv \
  >"$OUT/nvidia-smi.csv" 2>&1 || echo "nvidia-smi not available" >"$OUT/nvidia-smi.csv"

echo "== one tick"
"$PY" -m gpuledger.agents.gpu_agent --backend nvml --once --print --node "$(hostname)" --log-level INFO \
  >"$OUT/tick.json" 2>"$OUT/tick.log"
"$PY" - "$OUT/tick.json" <<'PYEOF'
import sys
from gpuledger.schemas.models import NodeTick
from gpuledger.schemas.wire import decode
tick = decode(NodeTick, open(sys.argv[1], "rb").read().strip())
for g in tick.gpus:
    print(f"  gpu {g.index} {g.model} {g.gpu_uuid} health={g.health.value} util={g.util_gpu_pct}% "
          f"power={g.power_w}W energy={g.energy_j}J temp={g.temperature_c}C procs={len(g.processes)}")
PYEOF

echo "== 20 ticks"
"$PY" -m gpuledger.agents.gpu_agent --backend nvml --bench 20 --log-level WARNING \
  >"$OUT/bench.json" 2>"$OUT/bench.log"
cat "$OUT/bench.json"

echo "== unit tests"
"$PY" -m pytest -q tests/unit/test_nvml_backend.py tests/unit/test_gpu_agent.py >"$OUT/pytest.log" 2>&1 \
  && tail -1 "$OUT/pytest.log" || { tail -30 "$OUT/pytest.log"; exit 1; }
echo "outputs in $OUT"
