#!/usr/bin/env bash
# Multi-worker GPU run, as across nodes, on one machine with 2+ GPUs (nvidia-h200-x2):
# `dask scheduler` and one `dask cuda worker` per GPU as separate processes (RMM pool,
# protocol tcp), joined with `mgpu submit --scheduler`; then one GPU worker is killed
# mid-job twice: its worker process under its nanny (the nanny restarts it), and its whole
# `dask cuda worker` process group (gone for good). Each job must still finish verified,
# with the lost worker and the recomputed tiles in its result. Logs, JSON and a summary go
# to OUT.
#
#   source .whl/env.sh && bash benchmarks/gpu_multiworker.sh "$OUT"
set -uo pipefail

OUT=${1:?usage: benchmarks/gpu_multiworker.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=$(mktemp -d /tmp/mgpu-gpu-cluster.XXXX)
SF=$DIR/scheduler.json
NGPU=$(nvidia-smi -L | grep -c '^GPU ')
POOL=${MGPU_POOL:-0.8}
exec > >(tee "$OUT/gpu_multiworker.log") 2>&1

say() { echo "[$(date +%T)] $*"; }
pids=()
cleanup() {
    say "stopping the cluster"
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    sleep 5
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    cp "$DIR"/*.log "$OUT"/ 2>/dev/null
}
trap cleanup EXIT

# `python3 -m dask cuda worker` needs dask-cuda's entry point; the click group directly
# works from PYTHONPATH alone.
if "$PY" -m dask cuda worker --help >/dev/null 2>&1; then
    cuda_worker=("$PY" -m dask cuda worker)
else
    cuda_worker=("$PY" -c 'import sys; from dask_cuda.cli import cuda; sys.exit(cuda(prog_name="dask cuda"))' worker)
fi

start() {  # start NAME CMD...: own session, log, remember the pid (= process group)
    local name=$1; shift
    setsid "$@" >"$DIR/$name.log" 2>&1 </dev/null &
    pids+=($!)
    echo $! >"$DIR/$name.pid"
}

say "$NGPU GPUs; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
"$PY" -c 'import dask, distributed, dask_cuda, rmm, cupy; print("dask", dask.__version__, "distributed", distributed.__version__, "dask-cuda", dask_cuda.__version__, "rmm", rmm.__version__, "cupy", cupy.__version__)'
start scheduler "$PY" -m distributed.cli.dask_scheduler --host 127.0.0.1 --port 0 --protocol tcp \
    --dashboard-address 127.0.0.1:0 --scheduler-file "$SF"
for _ in $(seq 100); do [[ -s $SF ]] && break; sleep 0.2; done
[[ -s $SF ]] || { say "the scheduler did not start"; exit 1; }
for ((i = 0; i < NGPU; i++)); do
    start "gpu-$i" env CUDA_VISIBLE_DEVICES="$i" "${cuda_worker[@]}" --scheduler-file "$SF" --host 127.0.0.1 \
        --protocol tcp --name "gpu-$i" --nthreads 1 --rmm-pool-size "$POOL" --set-rmm-allocator-for-libs cupy \
        --dashboard-address 127.0.0.1:0
done

cat >"$DIR/watch.py" <<'EOF'
"""wait for NGPU workers | kill a GPU worker once tiles are running on it."""
import os, signal, sys, time
from distributed import Client

sched, what = sys.argv[1], sys.argv[2]
with Client(scheduler_file=sched, timeout=60) as client:
    if what == "wait":
        client.wait_for_workers(int(sys.argv[3]), timeout=300)
        for addr, w in sorted(client.scheduler_info(n_workers=-1)["workers"].items()):
            print(f"  worker {w['name']} {addr}")
        sys.exit(0)
    name, mode, group_pid = sys.argv[3], sys.argv[4], int(sys.argv[5])
    workers = client.scheduler_info(n_workers=-1)["workers"]
    addr = next(a for a, w in workers.items() if str(w["name"]) == name)
    pid = client.run(os.getpid, workers=[addr])[addr]
    t0 = time.time()
    while not any(str(k).startswith("matmul-tile") for k in client.processing([addr]).get(addr, ())):
        if time.time() - t0 > 300:
            sys.exit(f"no tile reached {addr}")
        time.sleep(0.05)
    time.sleep(1.0)  # let some tiles finish first
    if mode == "process":
        print(f"SIGKILL worker process {pid} of {name} ({addr}) under its nanny", flush=True)
        os.kill(pid, signal.SIGKILL)
    else:
        print(f"SIGKILL the whole dask cuda worker of {name} ({addr}), process group {group_pid}", flush=True)
        os.killpg(group_pid, signal.SIGKILL)
EOF

"$PY" "$DIR/watch.py" "$SF" wait "$NGPU" || { tail -n 30 "$DIR"/*.log; exit 1; }
say "cluster up: $(cat "$SF" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["address"])')"

status=0
run() {  # run LABEL ARGS...: mgpu submit joined to the cluster
    local label=$1; shift
    say "mgpu submit $* (${label})"
    "$PY" -m mgpu submit "$@" --scheduler "$SF" --json "$OUT/$label.json"
    local rc=$?
    say "$label: exit $rc"
    [[ $rc == 0 ]] || status=1
}

# 1. Join: the GPU suite's 32k matmul on the workers the scheduler reports.
run join jobs/matmul-32k.yaml

# 2./3. A 65536 x 65536 x 65536 float32 matmul in 64 tiles of 8192 x 8192 (several seconds on
# two H200s), killing GPU 1's worker after its first tiles.
BIG=(jobs/matmul-32k.yaml --set params.m=65536 --set params.n=65536 --set params.k=65536
     --set 'tiling={m: 8192, n: 8192}' -q)
last=$((NGPU - 1))
"$PY" "$DIR/watch.py" "$SF" kill "gpu-$last" process "$(cat "$DIR/gpu-$last.pid")" &
watcher=$!
run kill-worker-process "${BIG[@]}"
wait $watcher || status=1
"$PY" "$DIR/watch.py" "$SF" wait "$NGPU" || status=1  # the nanny restarted it

"$PY" "$DIR/watch.py" "$SF" kill "gpu-$last" group "$(cat "$DIR/gpu-$last.pid")" &
watcher=$!
run kill-whole-worker "${BIG[@]}" --set params.seed=1
wait $watcher || status=1

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<22} {'status':<7} {'verify':<7} {'TFLOP/s':>8} {'tiles':>6} {'lost workers':<28} recomputed tiles")
for label in ("join", "kill-worker-process", "kill-whole-worker"):
    p = out / f"{label}.json"
    if not p.exists():
        print(f"{label:<22} (no result)")
        continue
    r = json.loads(p.read_text())
    rec = r["recovery"]
    print(f"{label:<22} {r['status']:<7} {str(r['verify']['passed']):<7} {r['throughput']['value']:>8.1f} "
          f"{r['plan']['tiles']:>6} {','.join(rec['lost_workers']) or '-':<28} "
          f"{len(rec['recomputed_tiles'])} {rec['recomputed_tiles'][:12]}")
    print(f"{'':<22} per device: " + ", ".join(f"{d['host']}:{d['id']} {d['tiles']} tiles" for d in r["per_device"]))
EOF
nvidia-smi --query-gpu=index,memory.used --format=csv
say "done, exit $status"
exit $status
