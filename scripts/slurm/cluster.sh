#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one host, for `make slurm-check` and for recording fixtures:
# munge, MariaDB + slurmdbd (sacct with GPU TRES), slurmctld, and 4 fake 8-GPU nodes gpu[01-04]
# (one slurmd each, dummy /dev/nvidia* character devices made with mknod c 195 N).
# Two partitions: batch (PriorityTier 1, preemptable with REQUEUE) and prod (PriorityTier 10).
#
#   scripts/slurm/cluster.sh start  [DIR]   # default DIR: build/slurm; prints the env to source
#   scripts/slurm/cluster.sh stop   [DIR]
#   scripts/slurm/cluster.sh status [DIR]
#   scripts/slurm/cluster.sh env    [DIR]   # `eval "$(scripts/slurm/cluster.sh env)"` sets SLURM_CONF
#   scripts/slurm/cluster.sh restart-ctld [DIR]   # kill and restart slurmctld (state kept)
# SLURM_MIN_JOB_AGE=N (default 600): seconds a finished job stays in squeue (MinJobAge)
# SLURM_ACCOUNTING=0: no MariaDB or slurmdbd, no AccountingStorage* in slurm.conf: a cluster without GPU
#   accounting (TRES strings carry no GPUs, sacct answers nothing), as newer_slurm.sh records it
# SLURM_CHROOT=ROOT: every daemon and client runs in that root filesystem instead (Slurm 24.11 from Debian
#   trixie, or newer: `scripts/slurm/newer_slurm.sh root ROOT [SUITE]` makes one, with slurmdbd; `source ROOT
#   SRC` one with Slurm built from SchedMD's source, e.g. 23.02, 23.11, 25.05 or 25.11); DIR is
#   bind-mounted at the same path inside, and DIR/bin holds wrappers (sbatch, squeue, …) that run the
#   root's commands: `start` and `env` print the PATH that puts them first.
# PrologSlurmctld is deploy/slurm/gpuledger-prolog-slurmctld (copied to DIR/etc), recording each job's GPUs at its
#   allocation in DIR/allocations: `gpuledger agent slurm --allocations-dir DIR/allocations` reads them.
#
# Every daemon runs as root in the background under setsid, its pid in DIR/run/*.pid; nothing
# outside DIR is written except the packages (installed when missing). No systemd needed.
# Ports: slurmctld 16817, slurmdbd 16819, MariaDB 13306 (127.0.0.1 only), slurmd 26818-26821.
set -euo pipefail

CMD="${1:-status}"
DIR="$(mkdir -p "${2:-build/slurm}" && cd "${2:-build/slurm}" && pwd)"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOST="$(hostname -s)"
NODES=(gpu01 gpu02 gpu03 gpu04)
CTLD_PORT=16817 DBD_PORT=16819 DB_PORT=13306
MIN_JOB_AGE="${SLURM_MIN_JOB_AGE:-600}"  # seconds a finished job stays in squeue
ACCOUNTING="${SLURM_ACCOUNTING:-1}"
MUNGE_SOCKET="$DIR/munge/run/munge.socket.2"
export SLURM_CONF="$DIR/etc/slurm.conf"
T=10  # seconds any client command may take (they hang while a daemon is down)
ROOTFS="${SLURM_CHROOT:-}"
# every Slurm and munge command the cluster runs, as wrappers into ROOTFS when there is one; MariaDB stays
# this host's (trixie's slurmdbd 24.11.5 and MariaDB 11.8 fail slurmdbd's first query: error 5027)
WRAPPED=(munged slurmdbd sacctmgr slurmctld slurmd scontrol sinfo squeue scancel sbatch sacct srun)

log() { echo "[slurm-cluster] $*" >&2; }

install_packages() {
  local missing=()
  if [[ -z "$ROOTFS" ]]; then  # in a root, Slurm and munge are the root's
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  fi
  ((ACCOUNTING)) && ! command -v mariadbd >/dev/null && ! command -v mysqld >/dev/null && missing+=(mariadb-server)
  if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -q >/dev/null
    timeout 900 apt-get install -y -q "${missing[@]}" >/dev/null
  fi
}

enter_root() {  # with SLURM_CHROOT: mounts, hosts entry, wrappers in DIR/bin first in PATH
  [[ -n "$ROOTFS" ]] || return 0
  [[ -x "$ROOTFS/usr/sbin/slurmdbd" ]] || {
    log "$ROOTFS has no slurmdbd: make it with scripts/slurm/newer_slurm.sh root $ROOTFS"; exit 1; }
  mountpoint -q "$ROOTFS/proc" || mount -t proc proc "$ROOTFS/proc"
  mountpoint -q "$ROOTFS/dev" || mount --bind /dev "$ROOTFS/dev"
  mkdir -p "$ROOTFS$DIR"
  mountpoint -q "$ROOTFS$DIR" || mount --bind "$DIR" "$ROOTFS$DIR"
  grep -q " $HOST\$" "$ROOTFS/etc/hosts" 2>/dev/null || echo "127.0.0.1 $HOST" >>"$ROOTFS/etc/hosts"
  mkdir -p "$DIR/bin"
  local c
  for c in "${WRAPPED[@]}"; do  # the root's own PATH: DIR/bin is inside it too
    printf '#!/bin/sh\nexec chroot %s /usr/bin/env PATH=/usr/sbin:/usr/bin:/sbin:/bin %s "$@"\n' "$ROOTFS" "$c" >"$DIR/bin/$c"
    chmod +x "$DIR/bin/$c"
  done
  export PATH="$DIR/bin:$PATH"
}

# A root's slurmd and cgroups: 24.05 on take CgroupPlugin=disabled (the root has no cgroup hierarchy); 23.02 and
# 23.11 have no such setting and fail without a plugin, so their root gets this host's /sys and cgroup.conf's autodetect
root_cgroups() {
  [[ -n "$ROOTFS" ]] || return 0
  local v
  v=$(chroot "$ROOTFS" /usr/sbin/slurmd -V | awk '{print $2}')
  if [[ "$(printf '%s\n' "$v" 24.05 | sort -V | head -n 1)" == 24.05 ]]; then
    echo "CgroupPlugin=disabled" >"$DIR/etc/cgroup.conf"
  else
    mountpoint -q "$ROOTFS/sys" || mount --rbind /sys "$ROOTFS/sys"
  fi
}

leave_root() {
  [[ -n "$ROOTFS" ]] || return 0
  local m
  mountpoint -q "$ROOTFS/sys" && umount -R "$ROOTFS/sys" || true
  for m in "$ROOTFS$DIR" "$ROOTFS/dev" "$ROOTFS/proc"; do mountpoint -q "$m" && umount "$m" || true; done
}

env_lines() {
  echo "export SLURM_CONF=$SLURM_CONF"
  [[ -z "$ROOTFS" ]] || echo "export PATH=$PATH"
}

alive() { [[ -f "$DIR/run/$1.pid" ]] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; }

# wait_for CMD...: retry up to ~20 s (bounded), quietly
wait_for() {
  local i
  for i in $(seq 1 80); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  log "timed out waiting for: $*"; return 1
}

render() {  # render TEMPLATE OUT: substitute @VARS@
  sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$HOST|g" -e "s|@MUNGE_SOCKET@|$MUNGE_SOCKET|g" \
      -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" -e "s|@DB_PORT@|$DB_PORT|g" -e "s|@MIN_JOB_AGE@|$MIN_JOB_AGE|g" "$1" >"$2"
}

start_munge() {
  alive munged && return 0
  mkdir -p "$DIR/munge/etc" "$DIR/munge/run" "$DIR/munge/lib" "$DIR/log"
  chmod 0700 "$DIR/munge/etc"; chmod 0755 "$DIR/munge/run"  # socket dir must be world-executable
  if [[ ! -s "$DIR/munge/etc/munge.key" ]]; then
    dd if=/dev/urandom of="$DIR/munge/etc/munge.key" bs=1024 count=1 status=none
  fi
  chmod 0400 "$DIR/munge/etc/munge.key"
  # munged forks itself; --force: the build directory's parents may be group-writable
  munged --force --key-file="$DIR/munge/etc/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/lib/munged.seed"
  wait_for test -S "$MUNGE_SOCKET"
}

start_mariadb() {
  alive mariadbd && return 0
  local first=0
  if [[ ! -d "$DIR/mysql/data/mysql" ]]; then
    first=1
    mkdir -p "$DIR/mysql/data"
    timeout 120 mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql/data" \
      --auth-root-authentication-method=socket >"$DIR/log/mariadb-install.log" 2>&1
  fi
  setsid mariadbd --no-defaults --user=root --datadir="$DIR/mysql/data" --socket="$DIR/mysql/mysqld.sock" \
    --bind-address=127.0.0.1 --port=$DB_PORT --pid-file="$DIR/run/mariadbd.pid" \
    --log-error="$DIR/log/mariadbd.log" --innodb-buffer-pool-size=64M --skip-log-bin \
    </dev/null >/dev/null 2>&1 &
  echo $! >"$DIR/run/mariadbd.pid"
  wait_for mariadb --no-defaults --socket="$DIR/mysql/mysqld.sock" -u root -e "SELECT 1"
  if ((first)); then
    mariadb --no-defaults --socket="$DIR/mysql/mysqld.sock" -u root -e "
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
      CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  fi
}

start_slurmdbd() {
  alive slurmdbd && return 0
  # slurmdbd reads slurmdbd.conf beside $SLURM_CONF
  setsid slurmdbd -D </dev/null >>"$DIR/log/slurmdbd.out" 2>&1 &
  echo $! >"$DIR/run/slurmdbd.pid"
  wait_for bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
  # the cluster and the test accounts (accounts are lower-cased by Slurm anyway)
  timeout $T sacctmgr -i add cluster gpuledger >/dev/null 2>&1 || true
  timeout $T sacctmgr -i add account teama,teamb,teamc cluster=gpuledger >/dev/null 2>&1 || true
  timeout $T sacctmgr -i add user root account=teama,teamb,teamc >/dev/null 2>&1 || true
}

start_slurmctld() {
  alive slurmctld && return 0
  setsid slurmctld -D -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 &
  echo $! >"$DIR/run/slurmctld.pid"
  wait_for timeout 3 scontrol ping
}

start_slurmd() {
  local n=$1
  alive "slurmd-$n" && return 0
  mkdir -p "$DIR/spool/$n"
  setsid slurmd -D -N "$n" -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 &
  echo $! >"$DIR/run/slurmd-$n.pid"
}

prolog_slurmctld() {  # the shipped script under DIR (a chroot sees DIR), run with this cluster's settings
  mkdir -p "$DIR/allocations"
  cp "$HERE/../../deploy/slurm/gpuledger-prolog-slurmctld" "$DIR/etc/gpuledger-prolog-slurmctld"
  printf '#!/bin/sh\nGPULEDGER_SLURM_AGENT_ALLOCATIONS_DIR=%s SLURM_CONF=%s exec /bin/sh %s\n' "$DIR/allocations" \
    "$SLURM_CONF" "$DIR/etc/gpuledger-prolog-slurmctld" >"$DIR/etc/prolog-slurmctld"
  chmod 0755 "$DIR/etc/gpuledger-prolog-slurmctld" "$DIR/etc/prolog-slurmctld"
}

make_devices() {
  local n i minor=0
  for n in "${NODES[@]}"; do
    mkdir -p "$DIR/dev/$n"
    for i in 0 1 2 3 4 5 6 7; do
      # dummy NVIDIA character devices (major 195): Slurm only needs them to exist
      [[ -e "$DIR/dev/$n/nvidia$i" ]] || mknod "$DIR/dev/$n/nvidia$i" c 195 $((minor % 256))
      minor=$((minor + 1))
    done
  done
}

cmd_start() {
  install_packages  # with SLURM_CHROOT: MariaDB only (with accounting)
  mkdir -p "$DIR"/{etc,run,log,state,spool}
  enter_root
  make_devices
  render "$HERE/slurm.conf.in" "$DIR/etc/slurm.conf"
  ((ACCOUNTING)) || sed -i "/^AccountingStorage/d" "$DIR/etc/slurm.conf"
  render "$HERE/gres.conf.in" "$DIR/etc/gres.conf"
  render "$HERE/slurmdbd.conf.in" "$DIR/etc/slurmdbd.conf"
  render "$HERE/cgroup.conf.in" "$DIR/etc/cgroup.conf"
  prolog_slurmctld
  root_cgroups
  chmod 0600 "$DIR/etc/slurmdbd.conf"
  start_munge
  if ((ACCOUNTING)); then start_mariadb; start_slurmdbd; fi
  start_slurmctld
  local n
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  # all four nodes idle (bounded wait); `scontrol reconfigure` hurries re-registration
  if ! wait_for bash -c "[[ \$(timeout 3 sinfo -h -N -t idle,mix,alloc -o %N | sort -u | wc -l) -ge ${#NODES[@]} ]]"; then
    timeout $T scontrol reconfigure || true
    wait_for bash -c "[[ \$(timeout 3 sinfo -h -N -t idle,mix,alloc -o %N | sort -u | wc -l) -ge ${#NODES[@]} ]]"
  fi
  log "up: $(timeout $T sinfo -V) $(timeout $T sinfo -h -o '%P %D %T %N' | tr '\n' ';')"
  env_lines
}

stop_pid() {  # stop_pid NAME: SIGTERM, bounded wait, then SIGKILL
  local name=$1 pid i
  [[ -f "$DIR/run/$name.pid" ]] || return 0
  pid=$(cat "$DIR/run/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$DIR/run/$name.pid"
}

cmd_stop() {
  local n
  enter_root
  # jobs' processes first (children of slurmstepd, in their own sessions): cancel, then stop daemons
  if alive slurmctld; then
    timeout 5 scancel --user=root >/dev/null 2>&1 || true
    # bounded wait until the steps are gone (slurmstepd kills the job's processes)
    for n in $(seq 1 40); do
      [[ -z "$(timeout 3 squeue -h -t running,completing,configuring -o %i 2>/dev/null)" ]] && break
      sleep 0.25
    done
  fi
  for n in "${NODES[@]}"; do stop_pid "slurmd-$n"; done
  stop_pid slurmctld
  stop_pid slurmdbd
  stop_pid mariadbd
  if alive munged; then munged --stop --socket="$MUNGE_SOCKET" >/dev/null 2>&1 || stop_pid munged; fi
  rm -f "$DIR/run/munged.pid"
  leave_root
  log "stopped"
}

cmd_status() {
  local name rc=0 dbd=(mariadbd slurmdbd)
  enter_root
  ((ACCOUNTING)) || dbd=()
  for name in munged "${dbd[@]}" slurmctld "${NODES[@]/#/slurmd-}"; do
    if alive "$name"; then echo "$name running (pid $(cat "$DIR/run/$name.pid"))"; else echo "$name stopped"; rc=1; fi
  done
  alive slurmctld && timeout $T sinfo -N -o '%N %P %T %G' || true
  return $rc
}

cmd_restart_ctld() {
  enter_root
  stop_pid slurmctld
  start_slurmctld
  timeout $T scontrol reconfigure >/dev/null 2>&1 || true
}

case "$CMD" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) enter_root; env_lines ;;
  restart-ctld) cmd_restart_ctld ;;
  *) echo "usage: $0 start|stop|status|env|restart-ctld [DIR]" >&2; exit 2 ;;
esac
