#!/usr/bin/env bash
# Newer Slurm than this host's Debian 12 (22.05), from a newer Debian in a chroot: its packages need a newer libc,
# so debootstrap makes the root: trixie (Debian 13) has Slurm 24.11.5, forky (testing) had 26.05.5 on 2026-12-07.
# `root` only makes it (with slurmdbd): `make slurm-check-24` / `slurm-check-26` run cluster.sh in it
# (SLURM_CHROOT), sacct included. `source` makes a Debian 12 root and builds Slurm in it from SchedMD's source (a
# release tarball unpacked, or `git archive` of a tag): the versions no Debian suite ships (23.02, 23.11, 25.05, 25.11);
# `make slurm-check-src` runs the check in it. `record` starts cluster.sh's cluster in it without accounting
# (SLURM_ACCOUNTING=0: no slurmdbd, so no GPUs in TRES strings; SLURM_ACCOUNTING=1 in the environment keeps it: 23.02's
# squeue --json fails without it, "loading QOS for parser failed"), in a fresh OUT/cluster (job ids from 1), plays a
# story, records what Slurm and the agent print, and stops the cluster. It takes cluster.sh's ports: not beside
# `make slurm-check` or another cluster.sh cluster.
#
#   scripts/slurm/newer_slurm.sh root   [ROOT] [SUITE]  # only make ROOT (~40 s); default /srv/trixie, trixie
#   scripts/slurm/newer_slurm.sh source ROOT SRC         # ROOT with Slurm built from the source tree SRC (~4 min on 2 cores)
#   scripts/slurm/newer_slurm.sh record [ROOT] [OUT]    # the story (ROOT made first when missing); OUT default build/slurm24-rec
#
# `record` writes squeue_<moment>.json, sinfo_<moment>.json, nodes_<moment>.json (scontrol show nodes
# --json) and agent_<moment>.jsonl (`gpuledger agent slurm --once --print`, state kept between moments)
# for the moments running, changed, whole, preempted, done (tests/fixtures/slurm/README.md).
set -euo pipefail
CMD="${1:-}"
R="${2:-/srv/trixie}"
SUITE=trixie OUT= SRC=
case "$CMD" in
  root) SUITE="${3:-trixie}" ;;
  source) SRC="$(cd "${3:?usage: $0 source ROOT SRC}" && pwd)" ;;
  record) OUT="$(mkdir -p "${3:-build/slurm24-rec}" && cd "${3:-build/slurm24-rec}" && pwd)" ;;
esac
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$HERE/../.." && pwd)"
log() { echo "[newer-slurm] $*" >&2; }

has_slurm() {  # asked inside the root: its /usr/sbin/slurmctld links to its own /etc/alternatives, not the host's
  [[ -d "$R" ]] && chroot "$R" test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmdbd
}

# debootstrap SUITE (minbase and PACKAGES) into R.partial, which the caller renames to R when complete: a failed run
# leaves no half root for the next to trip on (never mounted into, so it can be removed); its log stays beside R
debootstrap_partial() {
  local suite=$1 packages=$2
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
  # a debootstrap older than the suite has no script for it: Debian's suites all take sid's
  local script=/usr/share/debootstrap/scripts/$suite
  [[ -e "$script" ]] || script=/usr/share/debootstrap/scripts/sid
  rm -rf "$R.partial"
  mkdir -p "$(dirname "$R")"
  if ! timeout 1200 debootstrap --variant=minbase --include="$packages" "$suite" "$R.partial" \
      http://deb.debian.org/debian "$script" >"$R.debootstrap.log" 2>&1; then
    log "debootstrap failed ($R.debootstrap.log, $R.partial/debootstrap/debootstrap.log); its last lines:"
    tail -n 15 "$R.debootstrap.log" >&2
    exit 1
  fi
}

finish_root() {
  [[ ! -e "$R" ]] || rmdir "$R"  # an empty directory the operator made; anything else stops here
  mv "$R.partial" "$R"
}

make_root() {  # SUITE with its Slurm and slurmdbd (`make slurm-check-24` runs cluster.sh in it)
  has_slurm && return 0
  log "debootstrap $SUITE into $R"
  debootstrap_partial "$SUITE" slurm-wlm,munge,slurm-client,slurmdbd
  finish_root
}

# what building Slurm from source needs in a Debian 12 root (json-c: the --json output the agent reads; MariaDB's
# client library: slurmdbd's accounting_storage/mysql; munge: auth/munge), and munged itself
BUILD_PACKAGES=build-essential,pkg-config,python3,munge,libmunge-dev,libjson-c-dev,libmariadb-dev,libyaml-dev,liblz4-dev,zlib1g-dev

make_source_root() {  # R with SRC's Slurm built and installed in it (/usr, /etc/slurm), as the Debian roots have theirs
  if has_slurm; then
    log "$R has a Slurm already ($(chroot "$R" /usr/sbin/slurmctld -V)): remove it to build $SRC"; return 0
  fi
  log "debootstrap bookworm with build tools into $R"
  debootstrap_partial bookworm "$BUILD_PACKAGES"
  mkdir -p "$R.partial/usr/src"
  cp -a "$SRC" "$R.partial/usr/src/slurm"
  log "building $(sed -n 's/^ *Version:[[:space:]]*//p' "$SRC/META") (configure, make, make install: logs in $R.partial/usr/src/)"
  # --enable-multiple-slurmd: cluster.sh runs its four slurmd on this one host (Debian's packages are built so; without
  # it 23.11 refuses one NodeAddr for four nodes). slurmrestd is not built (no http-parser): the agent runs the
  # clients. The build's logs stay in the root.
  if ! timeout 3600 chroot "$R.partial" /bin/bash -c 'cd /usr/src/slurm && ./configure --prefix=/usr --sysconfdir=/etc/slurm \
      --enable-multiple-slurmd --disable-debug >../configure.log 2>&1 && make -j"$(nproc)" >../make.log 2>&1 && make install >../install.log 2>&1 && ldconfig'; then
    log "the build failed; the last lines of its logs:"; tail -n 20 "$R.partial"/usr/src/{configure,make,install}.log >&2 2>/dev/null; exit 1
  fi
  finish_root
}

cmd_record() {
  local st="$OUT/agent-state.json"
  dir="$OUT/cluster"  # global: the EXIT trap runs after this function's locals are gone
  make_root
  [[ ! -d "$dir/run" ]] || SLURM_CHROOT="$R" "$HERE/cluster.sh" stop "$dir"
  rm -rf "$dir" "$st"
  trap 'SLURM_CHROOT="$R" "$HERE/cluster.sh" stop "$dir"' EXIT
  # cluster.sh's wrappers (DIR/bin: squeue, sbatch, … in the root) come first in PATH, for the agent too
  eval "$(SLURM_CHROOT="$R" SLURM_ACCOUNTING="${SLURM_ACCOUNTING:-0}" "$HERE/cluster.sh" start "$dir")"
  sb() { timeout 20 sbatch --parsable -o /dev/null -D /tmp "$@" | cut -d';' -f1; }
  state_of() { timeout 20 squeue -h -j "$1" -o %T 2>/dev/null || true; }
  agent() { "$ROOT_DIR/.venv/bin/gpuledger" agent slurm --once --print --cluster gpuledger --state-file "$st"; }
  rec() {
    timeout 20 squeue --json --states=all >"$OUT/squeue_$1.json"
    timeout 20 sinfo --json >"$OUT/sinfo_$1.json"
    timeout 20 scontrol show nodes --json >"$OUT/nodes_$1.json"
    agent >"$OUT/agent_$1.jsonl" 2>"$OUT/agent_$1.log"
    log "$1: $(timeout 20 squeue -h -t all -o '%i:%T:%r' | tr '\n' ' ')"
  }
  sb -A teama --gres=gpu:2 --wrap "sleep 30" >/dev/null          # completes
  sb -A teamb --gres=gpu:1 --wrap "sleep 4; exit 3" >/dev/null    # exits 3
  local cancel req big urgent i
  cancel=$(sb -A teamc --gres=gpu:2 --wrap "sleep 300")           # cancelled
  sb -A teamb --array=0-2 --gres=gpu:1 --wrap "sleep 30" >/dev/null  # array 4_0-4_2 (tasks get job ids of their own as they start)
  sb -A teamc -N 2 --gres=gpu:4 --wrap "srun sleep 30" >/dev/null   # on 2 nodes
  req=$(sb -A teama --gres=gpu:2 --wrap "sleep 60")               # requeued, runs again
  big=$(sb -A teama -N 4 --gres=gpu:8 --wrap "sleep 10")          # the whole cluster, pending
  sleep 3; rec running
  timeout 20 scancel "$cancel"; timeout 20 scontrol requeue "$req"; sleep 4; rec changed
  for i in $(seq 1 100); do agent >>"$OUT/agent_between.jsonl" 2>>"$OUT/agent_between.log"
    [[ "$(state_of "$big")" == RUNNING ]] && break; sleep 2; done
  sleep 2; rec whole
  urgent=$(sb -p prod -A teamc --gres=gpu:8 --wrap "sleep 8")    # preempts the whole-cluster job (REQUEUE)
  for i in $(seq 1 30); do [[ "$(state_of "$urgent")" == RUNNING ]] && break; sleep 0.5; done
  sleep 1; rec preempted
  for i in $(seq 1 60); do agent >>"$OUT/agent_between.jsonl" 2>>"$OUT/agent_between.log"
    [[ -z "$(timeout 20 squeue -h -t running,pending,completing -o %i)" ]] && break; sleep 2; done
  sleep 1; rec done
}

case "$CMD" in
  root) make_root ;;
  source) make_source_root ;;
  record) cmd_record ;;
  *) echo "usage: $0 root [ROOT] [SUITE] | source ROOT SRC | record [ROOT] [OUT]" >&2; exit 2 ;;
esac
