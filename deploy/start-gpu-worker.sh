#!/usr/bin/env bash
# Join this node's GPUs to an mgpu cluster: `dask cuda worker` starts one worker per
# visible GPU (CUDA_VISIBLE_DEVICES chooses which), each with an RMM allocator that CuPy
# allocates through. Runs in the foreground.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: deploy/start-gpu-worker.sh SCHEDULER [POOL] [PROTOCOL] [-- EXTRA `dask cuda worker` ARGS...]

  SCHEDULER  tcp://HOST:8786, ucx://HOST:8786, or the path of a scheduler file
  POOL       the allocator of each GPU worker (default 0.8):
               a size: an RMM pool of that size per GPU: a fraction of the GPU's memory
                       (0.8), bytes, or a string like "40GB"
               async   RMM on cudaMallocAsync
               managed RMM on CUDA managed (unified) memory
               none    no RMM (CuPy's own memory pool)
  PROTOCOL   tcp | ucx (default: the scheme of SCHEDULER, or tcp for a scheduler file);
             must match the scheduler's
  PYTHON     interpreter that runs dask (default python3); mgpu and the cuda extra
             (pip install -e '.[cuda13]') must be installed in it

example:   deploy/start-gpu-worker.sh tcp://node001:8786 0.8 tcp -- --interface ib0
USAGE
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
case $1 in -h|--help) usage; exit 0 ;; esac
PYTHON=${PYTHON:-python3}
scheduler=$1
shift
pool=0.8
protocol=
[[ $# -gt 0 && $1 != -- ]] && { pool=$1; shift; }
[[ $# -gt 0 && $1 != -- ]] && { protocol=$1; shift; }
[[ $# -gt 0 && $1 == -- ]] && shift

if [[ -z $protocol ]]; then
    case $scheduler in
        ucx://*) protocol=ucx ;;
        *) protocol=tcp ;;
    esac
fi
[[ $protocol == tcp || $protocol == ucx ]] || { usage >&2; echo "PROTOCOL: expected tcp or ucx, got $protocol" >&2; exit 2; }

if [[ -f $scheduler ]]; then
    where=(--scheduler-file "$scheduler")
elif [[ $scheduler == *://* ]]; then
    where=("$scheduler")
else
    usage >&2
    echo "SCHEDULER: $scheduler is neither an address (tcp://HOST:8786) nor an existing scheduler file" >&2
    exit 2
fi

case $pool in
    none) rmm=() ;;
    async) rmm=(--rmm-async --set-rmm-allocator-for-libs cupy) ;;
    managed) rmm=(--rmm-managed-memory --set-rmm-allocator-for-libs cupy) ;;
    *) rmm=(--rmm-pool-size "$pool" --set-rmm-allocator-for-libs cupy) ;;
esac

# One thread per worker: mgpu runs one tile at a time on each GPU, on the worker's stream.
args=("${where[@]}" --protocol "$protocol" --nthreads 1 "${rmm[@]}")
echo "start-gpu-worker: $PYTHON -m dask cuda worker ${args[*]} $*" >&2
exec "$PYTHON" -m dask cuda worker "${args[@]}" "$@"
