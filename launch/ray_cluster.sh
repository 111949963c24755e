#!/usr/bin/env bash
# Start, join, wait for, and stop a Ray cluster; used by the Slurm templates and usable by hand.
#
#   ray_cluster.sh head   [--port P] [--dashboard-port P] [--num-cpus N] [--num-gpus N]
#                         [--object-store-bytes B] [--resources JSON] [--node-ip IP]
#   ray_cluster.sh worker --address HOST:PORT [--num-cpus N] [--num-gpus N] [--object-store-bytes B]
#                         [--resources JSON] [--node-ip IP]
#   ray_cluster.sh wait   --address HOST:PORT --nodes N [--timeout SECONDS]
#   ray_cluster.sh submit --address HOST:PORT [--dashboard-port P] [--working-dir DIR] -- COMMAND...
#   ray_cluster.sh stop   [--node-ip IP]
#
# head/worker block in the foreground (so srun keeps them alive) and stop Ray when they get SIGTERM.
# `stop` stops the node that head/worker started on this host (its address: --node-ip, else the host's
# first), not the other Ray nodes of the machine; their PIDs wait in $QURL_RAY_STATE_DIR (/tmp/qurl-ray).
# Every cluster runs with Ray's token authentication: the caller's token (RAY_AUTH_TOKEN, or the file named by
# RAY_AUTH_TOKEN_PATH), else `head` makes one of its own in $QURL_RAY_TOKEN_DIR (~/.qurl/ray, readable by the
# user only), where worker, wait and submit on a host sharing that directory find it by the head's address.
# The dashboard (Ray's job API) listens on the head's address, or on $QURL_RAY_DASHBOARD_HOST when set.
# Uses the `ray` and `python` found on PATH: activate the project's environment first.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "ray_cluster.sh: $*" >&2; exit 1; }

# Without token authentication anyone who reaches the dashboard's port submits jobs, that is runs code, through
# Ray's job API; and a client whose mode differs from the cluster's is refused (InvalidAuthToken).
if [[ "${RAY_AUTH_MODE:-token}" != token ]]; then
  die "clusters started here use token authentication; unset RAY_AUTH_MODE (it is '$RAY_AUTH_MODE')"
fi
export RAY_AUTH_MODE=token

cmd=${1:-}; [[ -n "$cmd" ]] || usage; shift
port=6379 dashboard_port=8265 address="" nodes="" timeout=600 working_dir="" node_ip=""
start_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    --dashboard-port) dashboard_port=$2; shift 2 ;;
    --address) address=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --working-dir) working_dir=$2; shift 2 ;;
    --num-cpus) start_args+=(--num-cpus "$2"); shift 2 ;;
    --num-gpus) start_args+=(--num-gpus "$2"); shift 2 ;;
    --object-store-bytes) start_args+=(--object-store-memory "$2"); shift 2 ;;
    --resources) start_args+=(--resources "$2"); shift 2 ;;
    --node-ip) node_ip=$2; start_args+=(--node-ip-address "$2"); shift 2 ;;
    --) shift; break ;;
    *) die "unknown option $1 (see the usage at the top of $0)" ;;
  esac
done

state_dir=${QURL_RAY_STATE_DIR:-/tmp/qurl-ray}
host_ip() { echo "${node_ip:-$(hostname -I 2>/dev/null | awk '{print $1}')}"; }
pid_file() {  # this host's Ray node: named by its address (hosts may share a machine, e.g. network namespaces)
  local ip
  ip=$(host_ip)
  echo "$state_dir/node-${ip:-$(hostname)}.pid"
}

token_dir=${QURL_RAY_TOKEN_DIR:-$HOME/.qurl/ray}
use_token() {  # use_token HEAD_ADDRESS [new|wait]: the caller's token, else the head's file (made anew with
  # "new"; with "wait", waited for up to $timeout s: the head may not have started yet)
  [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" ]] && return 0
  local path=$token_dir/token-${1//:/-}
  if [[ ${2:-} == wait ]]; then
    local deadline=$((SECONDS + ${timeout%.*}))
    while [[ ! -s $path ]] && (( SECONDS < deadline )); do sleep 1; done
  fi
  if [[ ${2:-} == new ]]; then
    (umask 077 && mkdir -p "$token_dir" && chmod 700 "$token_dir" &&
      od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$path")
    echo "[ray] token authentication: the token is in $path (mode 0600); a client on another host needs" \
      "RAY_AUTH_TOKEN_PATH naming a copy of it, or the token itself as RAY_AUTH_TOKEN"
  elif [[ ! -s $path ]]; then
    die "no token for the Ray cluster at $1: set RAY_AUTH_TOKEN_PATH to the head's token file (the head printed its path) or RAY_AUTH_TOKEN to the token"
  fi
  export RAY_AUTH_TOKEN_PATH=$path
}

# `ray start --head` records its address in Ray's temp directory, and every later `ray.init()` without an address
# on this machine goes there: forget it when this head ends (as `ray stop` does), unless another head replaced it.
current_cluster=${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster
forget_head() {
  if [[ $cmd == head && -f $current_cluster && $(<"$current_cluster") == *:"$port" ]]; then
    rm -f "$current_cluster"
  fi
}

run_blocking() {
  # `ray start --block` exits when its processes die. On SIGTERM (Slurm ending the step, or `stop`) pass the
  # signal on: it stops the processes it started and no others (`ray stop` would stop every Ray node on the
  # machine). Ray (2.60) first drains the node for up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s), for Ray
  # Serve's replicas: a qurl node serves nothing once its step ends, Slurm stops every node of a job at once (a
  # worker would drain towards a head that is gone, holding the nodes and delaying a requeue) and SIGKILLs what
  # still runs KillWait (30 s by default) after the SIGTERM; so it stops at once unless that variable is set.
  local pid_path
  pid_path=$(pid_file)
  mkdir -p "$state_dir"
  RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0} ray start "$@" --block &
  ray_pid=$!
  echo $$ > "$pid_path"
  trap 'kill -TERM "$ray_pid" 2>/dev/null; wait "$ray_pid" || true; rm -f "$pid_path"; forget_head; exit 0' TERM INT
  wait "$ray_pid"
  rm -f "$pid_path"
  forget_head
}

alive() {  # a process that ended but is not yet reaped by its parent (a zombie) counts as ended
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ $state != Z* ]]
}

stop_node() {
  local pid_path pid
  pid_path=$(pid_file)
  [[ -s "$pid_path" ]] || die "no Ray node of this host ($pid_path is missing): head/worker did not start one here, or it ended; 'ray stop --force' stops every Ray process of the machine"
  pid=$(<"$pid_path")
  kill -TERM "$pid" 2>/dev/null || { rm -f "$pid_path"; die "the Ray node of $pid_path (pid $pid) had ended"; }
  for _ in $(seq 1 120); do
    alive "$pid" || { echo "[ray] stopped the node of $pid_path"; return 0; }
    sleep 0.5
  done
  die "the Ray node of $pid_path (pid $pid) did not stop within 60 s"
}

case "$cmd" in
  head)
    head_ip=$(host_ip)
    use_token "$head_ip:$port" new
    run_blocking --head --port "$port" --dashboard-host "${QURL_RAY_DASHBOARD_HOST:-$head_ip}" \
      --dashboard-port "$dashboard_port" --disable-usage-stats "${start_args[@]}"
    ;;
  worker)
    [[ -n "$address" ]] || die "worker needs --address HOST:PORT of the head"
    use_token "$address"
    run_blocking --address "$address" --disable-usage-stats "${start_args[@]}"
    ;;
  wait)
    [[ -n "$address" && -n "$nodes" ]] || die "wait needs --address HOST:PORT and --nodes N"
    use_token "$address" wait
    python - "$address" "$nodes" "$timeout" <<'PY'
import sys, time
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
import ray
while True:
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        break
    except Exception as err:  # the head may not be listening yet
        if time.monotonic() > deadline:
            sys.exit(f"ray_cluster.sh wait: no Ray head at {address} after {timeout:.0f} s: {err}")
        time.sleep(2)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        print(f"[ray] {len(alive)}/{want} nodes up: {ray.cluster_resources()}", flush=True)
        break
    if time.monotonic() > deadline:
        sys.exit(f"ray_cluster.sh wait: only {len(alive)}/{want} nodes joined {address} within {timeout:.0f} s; "
                 "check the worker logs and that the head's port is reachable from every node")
    time.sleep(2)
PY
    ;;
  submit)
    [[ -n "$address" ]] || die "submit needs --address HOST:PORT"
    [[ $# -gt 0 ]] || die "submit needs a command after --"
    use_token "$address"
    host=${address%:*}
    wd=()
    [[ -n "$working_dir" ]] && wd=(--working-dir "$working_dir")
    ray job submit --address "http://$host:$dashboard_port" "${wd[@]}" -- "$@"
    ;;
  stop)
    stop_node
    ;;
  *) usage ;;
esac
