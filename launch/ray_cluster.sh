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
#   ray_cluster.sh auth-mode   (prints the RAY_AUTH_MODE every process of the cluster must share)
#
# head/worker block in the foreground (so srun keeps them alive) and stop Ray when they get SIGTERM.
# `stop` stops the node that head/worker started on this host (its address: --node-ip, else the host's
# first), not the other Ray nodes of the machine; their PIDs wait in $QURL_RAY_STATE_DIR (/tmp/qurl-ray).
# Uses the `ray` and `python` found on PATH: activate the project's environment first.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "ray_cluster.sh: $*" >&2; exit 1; }

auth_mode() {
  # `ray start --head` turns token auth on whenever a token exists (~/.ray/auth_token, e.g. left by any local
  # ray.init), but a client whose RAY_AUTH_MODE is unset then connects without it and gets InvalidAuthToken.
  # Pin one mode for every process: the caller's, else token when a token exists, else disabled.
  if [[ -n "${RAY_AUTH_MODE:-}" ]]; then echo "$RAY_AUTH_MODE"
  elif [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" || -s "$HOME/.ray/auth_token" ]]; then echo token
  else echo disabled
  fi
}
RAY_AUTH_MODE=$(auth_mode)
export RAY_AUTH_MODE

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
pid_file() {  # this host's Ray node: named by its address (hosts may share a machine, e.g. network namespaces)
  local ip=${node_ip:-$(hostname -I 2>/dev/null | awk '{print $1}')}
  echo "$state_dir/node-${ip:-$(hostname)}.pid"
}

run_blocking() {
  # `ray start --block` exits when its processes die. On SIGTERM (Slurm ending the step, or `stop`) pass the
  # signal on: it stops the processes it started and no others (`ray stop` would stop every Ray node on the
  # machine).
  local pid_path
  pid_path=$(pid_file)
  mkdir -p "$state_dir"
  ray start "$@" --block &
  ray_pid=$!
  echo $$ > "$pid_path"
  trap 'kill -TERM "$ray_pid" 2>/dev/null; wait "$ray_pid" || true; rm -f "$pid_path"; exit 0' TERM INT
  wait "$ray_pid"
  rm -f "$pid_path"
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
    run_blocking --head --port "$port" --dashboard-host 0.0.0.0 --dashboard-port "$dashboard_port" \
      --disable-usage-stats "${start_args[@]}"
    ;;
  worker)
    [[ -n "$address" ]] || die "worker needs --address HOST:PORT of the head"
    run_blocking --address "$address" --disable-usage-stats "${start_args[@]}"
    ;;
  wait)
    [[ -n "$address" && -n "$nodes" ]] || die "wait needs --address HOST:PORT and --nodes N"
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
    host=${address%:*}
    wd=()
    [[ -n "$working_dir" ]] && wd=(--working-dir "$working_dir")
    ray job submit --address "http://$host:$dashboard_port" "${wd[@]}" -- "$@"
    ;;
  stop)
    stop_node
    ;;
  auth-mode)
    echo "$RAY_AUTH_MODE"
    ;;
  *) usage ;;
esac
