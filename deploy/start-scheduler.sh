#!/usr/bin/env bash
# Run the Dask scheduler of a multi-node mgpu cluster, in the foreground.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: deploy/start-scheduler.sh [--host ADDR] [--port PORT] [--protocol tcp|ucx]
                                 [--scheduler-file PATH] [--dashboard-address ADDR]
                                 [-- EXTRA `dask scheduler` ARGS...]

  --host ADDR               address to listen on (default: every interface, so that
                            workers on other nodes can reach it)
  --port PORT               (default 8786)
  --protocol tcp|ucx        (default tcp); workers must use the same one
  --scheduler-file PATH     also write the address to PATH (on a shared filesystem, the
                            workers and `mgpu submit --scheduler PATH` can read it)
  --dashboard-address ADDR  (default :8787)
  PYTHON                    interpreter that runs dask (default python3)

Workers then join with:  deploy/start-gpu-worker.sh tcp://THIS_HOST:8786
and jobs run with:       python -m mgpu submit JOB --scheduler tcp://THIS_HOST:8786
USAGE
}

PYTHON=${PYTHON:-python3}
host=() file=()
port=8786 protocol=tcp dash=:8787
while [[ $# -gt 0 ]]; do
    case $1 in
        --host) host=(--host "${2:?--host needs an address}"); shift 2 ;;
        --port) port=${2:?--port needs a number}; shift 2 ;;
        --protocol)
            protocol=${2:?--protocol needs tcp or ucx}
            [[ $protocol == tcp || $protocol == ucx ]] || { usage >&2; echo "--protocol: expected tcp or ucx, got $protocol" >&2; exit 2; }
            shift 2 ;;
        --scheduler-file) file=(--scheduler-file "${2:?--scheduler-file needs a path}"); shift 2 ;;
        --dashboard-address) dash=${2:?--dashboard-address needs an address}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) usage >&2; echo "start-scheduler: unknown argument: $1" >&2; exit 2 ;;
    esac
done
args=(--port "$port" --protocol "$protocol" --dashboard-address "$dash" "${host[@]}" "${file[@]}")

echo "start-scheduler: $PYTHON -m dask scheduler ${args[*]} $*" >&2
exec "$PYTHON" -m dask scheduler "${args[@]}" "$@"
