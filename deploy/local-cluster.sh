#!/usr/bin/env bash
# A Dask cluster of separate processes on this machine (a scheduler plus N workers), the
# same shape as a multi-node deployment, for trying `mgpu submit --scheduler` locally.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: deploy/local-cluster.sh up [-n N] [--cpu | --gpu] [--host ADDR] [--port PORT]
                                  [--dashboard-port PORT] [--pool-size SIZE] [--dir DIR]
       deploy/local-cluster.sh status [--dir DIR]
       deploy/local-cluster.sh down [--dir DIR]

  up      start `dask scheduler` and N workers (`dask worker`, one thread each, with --cpu;
          `dask cuda worker`, one per GPU, with --gpu), each as its own process, write the
          scheduler file DIR/scheduler.json and wait until all N workers have joined.
          Default: --gpu when nvidia-smi lists a GPU and dask_cuda imports, else --cpu;
          N = the number of GPUs (gpu) or CPU cores (cpu).
  status  print the scheduler address and its workers.
  down    stop every process `up` started (workers first), by the ids it recorded.

  --host ADDR          address everything listens on (default 127.0.0.1)
  --port PORT          scheduler port (default 8786)
  --dashboard-port P   scheduler dashboard port (default 8787)
  --pool-size SIZE     RMM pool per GPU worker: bytes, a fraction or "40GB" (default 0.8)
  --dir DIR            where the scheduler file, pid files and logs go
                       (default $MGPU_CLUSTER_DIR or ${TMPDIR:-/tmp}/mgpu-cluster-$UID)
  PYTHON               the interpreter that runs dask (default python3); mgpu must be
                       importable by it, since the workers run mgpu's tasks.

then: python3 -m mgpu submit jobs/matmul.yaml --scheduler DIR/scheduler.json
EOF
}

die() { echo "local-cluster: $*" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
DIR=${MGPU_CLUSTER_DIR:-${TMPDIR:-/tmp}/mgpu-cluster-$(id -u)}
HOST=127.0.0.1
PORT=8786
DASH_PORT=8787
POOL=0.8
KIND=auto
N=

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
CMD=$1
shift
while [[ $# -gt 0 ]]; do
    case $1 in
        -n) N=${2:?-n needs a number}; shift 2 ;;
        --cpu) KIND=cpu; shift ;;
        --gpu) KIND=gpu; shift ;;
        --host) HOST=${2:?--host needs an address}; shift 2 ;;
        --port) PORT=${2:?--port needs a number}; shift 2 ;;
        --dashboard-port) DASH_PORT=${2:?--dashboard-port needs a number}; shift 2 ;;
        --pool-size) POOL=${2:?--pool-size needs a size}; shift 2 ;;
        --dir) DIR=${2:?--dir needs a folder}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done
SCHED_FILE=$DIR/scheduler.json

gpu_count() {
    command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
}

# pid files hold the id of each process `up` started; each is started by setsid, so it
# leads a process group of its own: its id is also its process group and `down` reaches its children too.
pids() { cat "$DIR"/*.pid 2>/dev/null || true; }
alive() { kill -0 -- "-$1" 2>/dev/null; }

start() {  # start NAME COMMAND...: run in the background under setsid, log, record pid
    local name=$1
    shift
    setsid "$@" >"$DIR/$name.log" 2>&1 </dev/null &
    echo $! >"$DIR/$name.pid"
}

wait_workers() {  # wait_workers N TIMEOUT_S
    "$PYTHON" - "$SCHED_FILE" "$1" "$2" <<'EOF'
import sys
from distributed import Client

path, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with Client(scheduler_file=path, timeout=timeout) as client:
    if n:
        client.wait_for_workers(n, timeout=timeout)
    info = client.scheduler_info(n_workers=-1)
    print(f"scheduler {info['address']}, dashboard {client.dashboard_link}")
    for addr, w in sorted(info["workers"].items()):
        print(f"  worker {w.get('name')} {addr} ({w['nthreads']} thread(s))")
EOF
}

cmd_up() {
    mkdir -p "$DIR"
    for pid in $(pids); do
        alive "$pid" && die "a cluster from $DIR is running (pid $pid); run: $0 down --dir $DIR"
    done
    rm -f "$DIR"/*.pid "$DIR"/*.log "$SCHED_FILE"

    if [[ $KIND == auto ]]; then
        if [[ $(gpu_count) -gt 0 ]] && "$PYTHON" -c "import dask_cuda" 2>/dev/null; then KIND=gpu; else KIND=cpu; fi
    fi
    local ngpu=0
    if [[ $KIND == gpu ]]; then
        ngpu=$(gpu_count)
        [[ $ngpu -gt 0 ]] || die "--gpu: nvidia-smi lists no GPU"
        N=${N:-$ngpu}
        [[ $N -le $ngpu ]] || die "-n $N: this machine has $ngpu GPU(s)"
    else
        N=${N:-$(nproc)}
    fi
    [[ $N =~ ^[1-9][0-9]*$ ]] || die "-n: expected a positive number, got $N"

    start scheduler "$PYTHON" -m dask scheduler --host "$HOST" --port "$PORT" \
        --dashboard-address "$HOST:$DASH_PORT" --scheduler-file "$SCHED_FILE"
    local sched_pid
    sched_pid=$(cat "$DIR/scheduler.pid")
    for _ in $(seq 150); do
        [[ -s $SCHED_FILE ]] && break
        # The process itself: its process group may not exist yet when setsid has not run.
        kill -0 "$sched_pid" 2>/dev/null || break
        sleep 0.2
    done
    [[ -s $SCHED_FILE ]] || { cat "$DIR/scheduler.log" >&2; cmd_down; die "the scheduler did not start"; }

    local i
    # --dashboard-address: even with --no-dashboard, a worker's HTTP server (/health,
    # /metrics) listens on every interface unless it is given an address.
    for ((i = 0; i < N; i++)); do
        if [[ $KIND == gpu ]]; then
            # One process per GPU: each sees only its own device, as on a multi-node cluster.
            start "worker-$i" env CUDA_VISIBLE_DEVICES="$i" "$PYTHON" -m dask cuda worker \
                --scheduler-file "$SCHED_FILE" --host "$HOST" --name "gpu-$i" --nthreads 1 \
                --rmm-pool-size "$POOL" --set-rmm-allocator-for-libs cupy --no-dashboard \
                --dashboard-address "$HOST:0"
        else
            # The name is the worker's index: mgpu reports CPU worker N as device N.
            start "worker-$i" "$PYTHON" -m dask worker --scheduler-file "$SCHED_FILE" \
                --host "$HOST" --name "$i" --nthreads 1 --nworkers 1 --no-dashboard \
                --dashboard-address "$HOST:0"
        fi
    done
    if ! wait_workers "$N" 120; then
        tail -n 20 "$DIR"/worker-*.log >&2 || true
        cmd_down
        die "the workers did not all join within 120 s"
    fi
    echo "$N $KIND worker(s) up; scheduler file $SCHED_FILE"
    echo "submit with: python3 -m mgpu submit JOB --scheduler $SCHED_FILE"
    echo "stop with:   $0 down --dir $DIR"
}

cmd_status() {
    [[ -s $SCHED_FILE ]] || die "no cluster in $DIR"
    wait_workers 0 10
}

cmd_down() {
    local pid left=()
    # Workers first, so none outlives the scheduler and tries to reconnect.
    for f in "$DIR"/worker-*.pid "$DIR"/scheduler.pid; do
        [[ -f $f ]] || continue
        pid=$(cat "$f")
        alive "$pid" && kill -TERM -- "-$pid" 2>/dev/null || true
        left+=("$pid")
    done
    for _ in $(seq 50); do
        local any=0
        for pid in "${left[@]}"; do alive "$pid" && any=1; done
        [[ $any == 0 ]] && break
        sleep 0.2
    done
    for pid in "${left[@]}"; do
        alive "$pid" && { echo "local-cluster: process group $pid ignored SIGTERM; killing" >&2; kill -KILL -- "-$pid" 2>/dev/null || true; }
    done
    rm -f "$DIR"/*.pid "$SCHED_FILE"
    echo "stopped ${#left[@]} process(es) from $DIR"
}

case $CMD in
    up) cmd_up ;;
    status) cmd_status ;;
    down) cmd_down ;;
    -h|--help) usage ;;
    *) usage >&2; die "unknown command: $CMD" ;;
esac
