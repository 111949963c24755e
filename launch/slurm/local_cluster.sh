#!/usr/bin/env bash
# A Slurm cluster on this machine, for tests and for trying the job templates without a real cluster. Needs root
# and Debian's slurmctld, slurmd, munge packages (installed when missing).
#
#   local_cluster.sh start|stop|status [STATE_DIR]
#       one node: munge + slurmctld + slurmd, all on 127.0.0.1, configured in /etc/slurm/slurm.conf
#       (default STATE_DIR: /tmp/qurl-slurm)
#   local_cluster.sh start|stop|status --netns STATE_DIR
#       one slurmd per node of launch/netns_cluster.sh (up already, same QURL_NETNS_PREFIX), each named after
#       its namespace and reached at its address; slurmctld on this host at SUBNET.254 on the nodes' bridge,
#       port 6827 (the one-node cluster keeps 6817). Configured in STATE_DIR/slurm.conf: clients (sbatch,
#       squeue, scontrol) need SLURM_CONF=STATE_DIR/slurm.conf.
#   `stop` stops only this cluster's daemons, by the PID files in STATE_DIR; munged, which all share, stays.
#   A STATE_DIR keeps Slurm's state across starts: a job that was running when its machine went away comes back
#   as running and holds the node, so later jobs pend. An empty STATE_DIR starts a cluster with no jobs.
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "local_cluster.sh: $*" >&2; exit 1; }

cmd=${1:-}; [[ -n "$cmd" ]] || usage; shift
netns=0
if [[ ${1:-} == --netns ]]; then
  netns=1
  state=${2:-}; [[ -n "$state" ]] || die "--netns needs a STATE_DIR"
else
  state=${1:-/tmp/qurl-slurm}
fi
state=$(realpath -m "$state")
netns_cluster="$(cd "$(dirname "$0")/.." && pwd)/netns_cluster.sh"
prefix=${QURL_NETNS_PREFIX:-qurl-node}
bridge="${prefix:0:10}-br"  # netns_cluster.sh's name for the nodes' bridge
if (( netns )); then conf=$state/slurm.conf; else conf=/etc/slurm/slurm.conf; fi
export SLURM_CONF=$conf

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  [[ $(id -u) == 0 ]] || die "installing Slurm needs root"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge
}

# write_conf CLUSTER CONTROLLER_ADDR PORT NODE_LINES: %n in the slurmd paths is the node's name, so that several
# slurmd on one machine keep their own spool directory, PID file and log.
write_conf() {
  local cluster=$1 ctld_addr=$2 port=$3 node_lines=$4
  if [[ -f "$conf" ]] && ! grep -q "^ClusterName=$cluster\$" "$conf"; then
    die "$conf belongs to another Slurm cluster; not touching it"
  fi
  mkdir -p "$state"/{ctld,d,log} "$(dirname "$conf")"
  cat > "$conf" <<CONF
ClusterName=$cluster
SlurmctldHost=$(hostname -s)($ctld_addr)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
MpiDefault=none
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

# slurmstepd listens on SlurmdSpoolDir/NODE_JOBID.STEPID, a Unix socket: the whole path must fit the kernel's
# 108 bytes (107 characters), or every job fails at launch and Slurm requeues it without end. Counted for job
# ids up to MaxJobId's default (8 digits) and a batch step's id (10 digits).
check_socket_room() {  # check_socket_room NODE_NAME
  local socket="$state/d/$1/${1}_12345678.4294967291"
  (( ${#socket} <= 107 )) || die "STATE_DIR $state is too long for slurmstepd's sockets (${#socket} > 107 characters in $socket); use a shorter STATE_DIR, e.g. under /tmp"
}

node_line() {  # node_line NAME ADDRESS: every node offers the whole machine
  local mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  echo "NodeName=$1 NodeAddr=$2 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN"
}

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge && dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown -R munge:munge /etc/munge 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  # its socket is a file, so the namespace nodes (which share the file system) reach it as well
  pgrep -x munged >/dev/null || munged --force
}

alive() { [[ -s "$1" ]] && kill -0 "$(<"$1")" 2>/dev/null; }

# check_port PORT: unless this STATE_DIR's slurmctld runs, nothing may listen on its port: a controller of another
# STATE_DIR would answer in its place, with its own jobs. Checked before the configuration is written.
check_port() {
  alive "$state/slurmctld.pid" && return
  if ss -Hltn "sport = :$1" | grep -q .; then
    die "port $1 is taken (a slurmctld of another STATE_DIR?); stop that cluster (local_cluster.sh stop ITS_DIR) or its process first"
  fi
}

wait_until_idle() {  # wait_until_idle N: every one of the N nodes idle (or running jobs)
  local up
  for _ in $(seq 60); do
    up=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$' || true)
    if (( up >= $1 )); then
      echo "[slurm] up: $(sinfo -h -o '%P %D %T %c CPUs %N')"
      return
    fi
    sleep 1
  done
  echo "[slurm] $up of $1 node(s) up after 60 s; logs in $state/log" >&2
  sinfo -N >&2 || true
  tail -n 20 "$state"/log/*.log >&2 || true
  exit 1
}

start() {
  install_packages
  check_socket_room "$(hostname -s)"
  check_port 6817
  write_conf qurl-local 127.0.0.1 6817 "$(node_line "$(hostname -s)" 127.0.0.1)"
  start_munge
  alive "$state/slurmctld.pid" || slurmctld
  alive "$state/slurmd-$(hostname -s).pid" || slurmd
  wait_until_idle 1
}

netns_nodes() {  # "K NAMESPACE ADDRESS" per node, or a clear error
  local list
  list=$(bash "$netns_cluster" list)
  [[ -n "$list" ]] || die "no nodes of prefix $prefix are up; run netns_cluster.sh up N first"
  echo "$list"
}

start_netns() {
  local list subnet ctld_addr lines="" ns addr
  install_packages
  list=$(netns_nodes)
  subnet=$(awk 'NR == 1 {sub(/\.[0-9]+$/, "", $3); print $3}' <<<"$list")
  ctld_addr=$subnet.254  # netns_cluster.sh gives nodes .1 to .250
  while read -r _ ns addr; do
    check_socket_room "$ns"
    lines+="$(node_line "$ns" "$addr")"$'\n'
  done <<<"$list"
  check_port 6827
  write_conf qurl-netns "$ctld_addr" 6827 "$lines"
  ip -o addr show dev "$bridge" | grep -q " $ctld_addr/" || ip addr add "$ctld_addr/24" dev "$bridge"
  start_munge
  alive "$state/slurmctld.pid" || slurmctld -f "$conf"
  while read -r _ ns _; do
    # into the node's network only: `netns_cluster.sh exec` (ip netns exec) also remounts /sys, which hides the
    # machine's cgroup mounts that slurmd needs ("No filesystem mounted on /sys/fs/cgroup")
    alive "$state/slurmd-$ns.pid" || nsenter --net="/run/netns/$ns" slurmd -f "$conf" -N "$ns"
  done <<<"$list"
  wait_until_idle "$(wc -l <<<"$list")"
}

# Stops this cluster's slurmd and slurmctld, by their PID files (never another cluster's); munged, which every
# cluster on the machine shares, stays.
stop() {
  local pid_file pid ctld_addr
  for pid_file in "$state"/slurmd-*.pid "$state"/slurmctld.pid; do
    alive "$pid_file" || continue
    pid=$(<"$pid_file")
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || continue 2; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true  # still there after 30 s
  done
  if (( netns )) && [[ -f "$conf" ]]; then
    ctld_addr=$(sed -n 's/^SlurmctldHost=.*(\(.*\))$/\1/p' "$conf")
    ip addr del "$ctld_addr/24" dev "$bridge" 2>/dev/null || true
  fi
  echo "[slurm] stopped the cluster of $conf"
}

case "$cmd" in
  start) if (( netns )); then start_netns; else start; fi ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  *) usage ;;
esac
