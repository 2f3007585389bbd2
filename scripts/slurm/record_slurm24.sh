#!/usr/bin/env bash
# Slurm 24.11 (Debian trixie's packages) in a chroot, for recording what newer Slurm prints: this host's
# Debian 12 has Slurm 22.05 and a libc too old for trixie's packages, so debootstrap makes a trixie root.
# `start` runs the same 4 fake 8-GPU nodes and partitions as cluster.sh without slurmdbd (no sacct), on ports
# 17817, 27818-27821, so it can run beside cluster.sh's cluster. `root` only makes the root (with slurmdbd):
# `make slurm-check-24` runs cluster.sh itself in it (SLURM_CHROOT), sacct included.
#
#   scripts/slurm/record_slurm24.sh root   [ROOT]        # only make ROOT (debootstrap; ~1.5 min), start nothing
#   scripts/slurm/record_slurm24.sh start  [ROOT]        # default ROOT /srv/trixie (made first when missing)
#   scripts/slurm/record_slurm24.sh record [ROOT] [OUT]  # the story; OUT default build/slurm24-rec
#   scripts/slurm/record_slurm24.sh stop   [ROOT]
#
# `record` writes squeue_<moment>.json, sinfo_<moment>.json, nodes_<moment>.json (scontrol show nodes
# --json) and agent_<moment>.jsonl (`gpuledger agent slurm --once --print`, state kept between moments)
# for the moments running, changed, whole, preempted, done (tests/fixtures/slurm/README.md).
set -euo pipefail
CMD="${1:-}"
R="${2:-/srv/trixie}"
OUT="$(mkdir -p "${3:-build/slurm24-rec}" && cd "${3:-build/slurm24-rec}" && pwd)"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT_DIR="$(cd "$HERE/../.." && pwd)"
H="$(hostname -s)"
log() { echo "[slurm24] $*" >&2; }
in_root() { timeout 20 chroot "$R" "$@"; }

make_root() {  # trixie with Slurm 24.11 and slurmdbd (`make slurm-check-24` runs cluster.sh in it)
  if [[ ! -x "$R/usr/sbin/slurmctld" || ! -x "$R/usr/sbin/slurmdbd" ]]; then
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
    log "debootstrap trixie into $R"
    mkdir -p "$R"
    timeout 1200 debootstrap --variant=minbase --include=slurm-wlm,munge,slurm-client,slurmdbd trixie "$R" \
      http://deb.debian.org/debian >/dev/null
  fi
}

cmd_start() {
  make_root
  mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
  mountpoint -q "$R/dev" || mount --bind /dev "$R/dev"
  grep -q " $H\$" "$R/etc/hosts" 2>/dev/null || echo "127.0.0.1 $H" >>"$R/etc/hosts"
  mkdir -p "$R/etc/slurm" "$R/var/spool/slurmctld" "$R/var/log/slurm" "$R/run/munge" "$R/etc/munge"
  local n i
  for n in 1 2 3 4; do
    mkdir -p "$R/gpudev/gpu0$n" "$R/var/spool/slurmd/gpu0$n"
    for i in 0 1 2 3 4 5 6 7; do  # dummy NVIDIA character devices, as cluster.sh
      [[ -e "$R/gpudev/gpu0$n/nvidia$i" ]] || mknod "$R/gpudev/gpu0$n/nvidia$i" c 195 $(((n - 1) * 8 + i))
    done
  done
  # cluster.sh's slurm.conf less accounting (AccountingStorageTRES needs slurmdbd), on other ports
  sed -e "s|@HOST@|$H|g" -e "s|@CTLD_PORT@|17817|g" -e "s|@MIN_JOB_AGE@|600|g" \
      -e "s|@MUNGE_SOCKET@|/run/munge/munge.socket.2|g" -e "s|@DIR@/state|/var/spool/slurmctld|g" \
      -e "s|@DIR@/spool|/var/spool/slurmd|g" -e "s|@DIR@/run|/run|g" -e "s|@DIR@/log|/var/log/slurm|g" \
      -e "s|^SlurmdPort=.*|SlurmdPort=27818|" -e "s|Port=26818-26821|Port=27818-27821|" \
      -e "/^AccountingStorage/d" "$HERE/slurm.conf.in" >"$R/etc/slurm/slurm.conf"
  { echo "AutoDetect=off"; for n in 1 2 3 4; do echo "NodeName=gpu0$n Name=gpu Type=a100 File=/gpudev/gpu0$n/nvidia[0-7]"; done; } \
    >"$R/etc/slurm/gres.conf"
  echo "CgroupPlugin=disabled" >"$R/etc/slurm/cgroup.conf"
  [[ -s "$R/etc/munge/munge.key" ]] || dd if=/dev/urandom of="$R/etc/munge/munge.key" bs=1024 count=1 status=none
  chmod 0700 "$R/etc/munge"; chmod 0400 "$R/etc/munge/munge.key"; chmod 0755 "$R/run/munge"
  [[ -S "$R/run/munge/munge.socket.2" ]] || in_root munged --force
  alive slurmctld || { in_root bash -c 'setsid slurmctld -D </dev/null >>/var/log/slurm/slurmctld.out 2>&1 & echo $! >/run/slurmctld.pid'; sleep 2; }
  for n in 1 2 3 4; do
    alive "slurmd-gpu0$n" || in_root bash -c "setsid slurmd -D -N gpu0$n </dev/null >>/var/log/slurm/slurmd-gpu0$n.out 2>&1 & echo \$! >/run/slurmd-gpu0$n.pid"
  done
  for i in $(seq 1 40); do
    [[ "$(in_root sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -ge 4 ]] && break
    sleep 0.5
  done
  log "up: $(in_root sinfo -V) $(in_root sinfo -h -o '%P %D %T' | tr '\n' ';')"
}

alive() { [[ -f "$R/run/$1.pid" ]] && kill -0 "$(cat "$R/run/$1.pid")" 2>/dev/null; }

cmd_stop() {
  local name
  for name in slurmd-gpu01 slurmd-gpu02 slurmd-gpu03 slurmd-gpu04 slurmctld; do
    alive "$name" && kill -TERM "$(cat "$R/run/$name.pid")" 2>/dev/null || true
    rm -f "$R/run/$name.pid"
  done
  [[ -f "$R/run/munge/munged.pid" ]] && kill -TERM "$(cat "$R/run/munge/munged.pid")" 2>/dev/null || true
  sleep 2
  mountpoint -q "$R/dev" && umount "$R/dev" || true
  mountpoint -q "$R/proc" && umount "$R/proc" || true
  log "stopped"
}

cmd_record() {
  local bin st
  bin="$(mktemp -d)"; st="$OUT/agent-state.json"
  for c in squeue sinfo scontrol sacct; do printf '#!/bin/sh\nexec chroot %s %s "$@"\n' "$R" "$c" >"$bin/$c"; chmod +x "$bin/$c"; done
  rm -f "$st"
  sb() { in_root sbatch --parsable -o /dev/null -D /tmp "$@" | cut -d';' -f1; }
  state_of() { in_root squeue -h -j "$1" -o %T 2>/dev/null || true; }
  agent() { PATH="$bin:$PATH" "$ROOT_DIR/.venv/bin/gpuledger" agent slurm --once --print --cluster gpuledger --state-file "$st"; }
  rec() {
    in_root squeue --json --states=all >"$OUT/squeue_$1.json"
    in_root sinfo --json >"$OUT/sinfo_$1.json"
    in_root scontrol show nodes --json >"$OUT/nodes_$1.json"
    agent >"$OUT/agent_$1.jsonl" 2>"$OUT/agent_$1.log"
    log "$1: $(in_root squeue -h -t all -o '%i:%T:%r' | tr '\n' ' ')"
  }
  sb -A teama --gres=gpu:2 --wrap "sleep 30" >/dev/null          # 1 completes
  sb -A teamb --gres=gpu:1 --wrap "sleep 4; exit 3" >/dev/null    # 2 exits 3
  local cancel req big urgent i
  cancel=$(sb -A teamc --gres=gpu:2 --wrap "sleep 300")           # 3 cancelled
  sb -A teamb --array=0-2 --gres=gpu:1 --wrap "sleep 30" >/dev/null  # 4_0-4_2
  sb -A teamc -N 2 --gres=gpu:4 --wrap "srun sleep 30" >/dev/null   # 5 on 2 nodes
  req=$(sb -A teama --gres=gpu:2 --wrap "sleep 60")               # 6 requeued, runs again
  big=$(sb -A teama -N 4 --gres=gpu:8 --wrap "sleep 10")          # 7 the whole cluster, pending
  sleep 3; rec running
  in_root scancel "$cancel"; in_root scontrol requeue "$req"; sleep 4; rec changed
  for i in $(seq 1 100); do agent >>"$OUT/agent_between.jsonl" 2>>"$OUT/agent_between.log"
    [[ "$(state_of "$big")" == RUNNING ]] && break; sleep 2; done
  sleep 2; rec whole
  urgent=$(sb -p prod -A teamc --gres=gpu:8 --wrap "sleep 8")    # 10 preempts 7 (REQUEUE)
  for i in $(seq 1 30); do [[ "$(state_of "$urgent")" == RUNNING ]] && break; sleep 0.5; done
  sleep 1; rec preempted
  for i in $(seq 1 60); do agent >>"$OUT/agent_between.jsonl" 2>>"$OUT/agent_between.log"
    [[ -z "$(in_root squeue -h -t running,pending,completing -o %i)" ]] && break; sleep 2; done
  sleep 1; rec done
  rm -rf "$bin"
}

case "$CMD" in
  root) make_root ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  record) cmd_record ;;
  *) echo "usage: $0 root|start|record|stop [ROOT] [OUT]" >&2; exit 2 ;;
esac
