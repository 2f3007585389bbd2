#!/usr/bin/env bash
# The Superset end-to-end check (tests/superset/test_superset_e2e.py) with everything it needs:
#   - Superset 6.1 in its own venv (build/superset-venv; never the project venv), with the
#     clickhouse-connect dialect and chDB so it reads the embedded warehouse;
#   - Debian's chromium and npm's playwright-core (build/screenshot-node) for the screenshots.
# Idempotent: each install is skipped when its stamp is there. Screenshots: build/screenshots/.
#
#   scripts/superset_check.sh            # what `make superset-check` runs
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
SS_VENV=build/superset-venv
SS_STAMP=$SS_VENV/.installed-6.1.0
NODE_DIR=build/screenshot-node
NODE_STAMP=$NODE_DIR/.installed
t0=$(date +%s)
say() { echo "[superset-check +$(( $(date +%s) - t0 ))s] $*" >&2; }

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.installed" ]; then
  say "installing the project into $VENV"
  make install PYTHON="$PYTHON" VENV="$VENV"
fi

# Downloads are the only step that depends on the network: each tool retries its own transfers
# (pip --retries, apt Acquire::Retries, npm --fetch-retries), so the check itself runs once.
PIP_NET=(--retries 10 --timeout 60)
APT_NET=(-o Acquire::Retries=5)

if [ ! -f "$SS_STAMP" ]; then
  say "installing Superset into $SS_VENV (once; ~2 min)"
  rm -rf "$SS_VENV"
  "$PYTHON" -m venv "$SS_VENV"
  "$SS_VENV/bin/pip" install -q "${PIP_NET[@]}" --upgrade pip
  # the [clickhouse] extra pins clickhouse-connect below 1.0: install the dialect and chDB ourselves;
  # rich, cachetools and flask-caching<2.4 are needed at run time by this release
  "$SS_VENV/bin/pip" install -q "${PIP_NET[@]}" "apache-superset==6.1.0" rich cachetools "flask-caching<2.4" \
      "clickhouse-connect>=0.8" "chdb-core>=26.0"
  touch "$SS_STAMP"
fi

if ! command -v chromium >/dev/null 2>&1; then
  say "installing chromium (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq "${APT_NET[@]}"
  apt-get install -y -qq "${APT_NET[@]}" chromium >/dev/null
fi

if ! command -v node >/dev/null 2>&1; then
  say "installing nodejs and npm (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq "${APT_NET[@]}"
  apt-get install -y -qq "${APT_NET[@]}" nodejs npm >/dev/null
fi

if [ ! -f "$NODE_STAMP" ]; then
  say "installing playwright-core into $NODE_DIR"
  mkdir -p "$NODE_DIR"
  [ -f "$NODE_DIR/package.json" ] || echo '{"private": true}' > "$NODE_DIR/package.json"
  # playwright-core only: it drives the system chromium and downloads no browser
  (cd "$NODE_DIR" && npm install --no-audit --no-fund --silent --fetch-retries 5 "playwright-core@1")
  touch "$NODE_STAMP"
fi

say "running the end-to-end test"
export GPULEDGER_SUPERSET_CHECK=1 CHROMIUM=${CHROMIUM:-$(command -v chromium)}
export GPULEDGER_SUPERSET_VENV="$ROOT/$SS_VENV" GPULEDGER_SCREENSHOT_NODE_MODULES="$ROOT/$NODE_DIR/node_modules"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/superset "$@"
say "done; screenshots: $(ls build/screenshots/*.png 2>/dev/null | tr '\n' ' ')"
