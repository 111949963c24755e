#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (munge + slurmctld + slurmd, all on 127.0.0.1), for tests and for
# trying the job templates without a real cluster. Needs root and Debian's slurmctld, slurmd, munge packages.
# Usage: local_cluster.sh start|stop|status [STATE_DIR]   (default STATE_DIR: /tmp/qurl-slurm)
set -euo pipefail
cmd=${1:?usage: local_cluster.sh start|stop|status [STATE_DIR]}
state=${2:-/tmp/qurl-slurm}
conf=/etc/slurm/slurm.conf

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  [[ $(id -u) == 0 ]] || { echo "local_cluster.sh: installing Slurm needs root" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge
}

write_conf() {
  local host cpus mem
  if [[ -f "$conf" ]] && ! grep -q '^ClusterName=qurl-local$' "$conf"; then
    echo "local_cluster.sh: $conf belongs to another Slurm cluster; not touching it" >&2
    exit 1
  fi
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p "$state"/{ctld,d,log} /etc/slurm
  cat > "$conf" <<CONF
ClusterName=qurl-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start() {
  install_packages
  write_conf
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge && dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown -R munge:munge /etc/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  pgrep -x munged >/dev/null || munged --force
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "[slurm] up: $(sinfo -h -o '%P %D %T %c CPUs')"
      return
    fi
    sleep 1
  done
  echo "[slurm] did not come up in 60 s; logs in $state/log" >&2
  tail -20 "$state"/log/*.log >&2 || true
  exit 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
  pkill -x munged || true
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  *) echo "usage: local_cluster.sh start|stop|status [STATE_DIR]" >&2; exit 2 ;;
esac
