#!/usr/bin/env bash
# The dot and the streamed matmul from .npy files, run by several versions of mgpu in turn on
# the same files, the same machine and the same call: tells the code's share of a change in
# their rates from the host's (what ran before them). Run from the repository root, with each
# other version's package exported beside it first, e.g.
#   mkdir -p versions/old && git archive dfec80a mgpu | tar -x -C versions/old
#   OUT=/some/folder bash benchmarks/compare_versions.sh
# (versions/ is ignored by git: a copy of the tree made elsewhere must be given it.)
# VERSIONS (default "old main") names them: main is this tree, any other versions/NAME. Each
# result is OUT/{dot,mm}-VERSION-REPEAT.json; the last lines printed set them side by side.
set -euo pipefail
OUT=$(realpath -m "${OUT:-/tmp/mgpu-ab}")
D=${SCRATCH:-/dev/shm}/mgpu-ab
N_DOT=${N_DOT:-2200000000}
N_MM=${N_MM:-32768}
DOT_BUDGET=${DOT_BUDGET:-16GiB}
MM_BUDGET=${MM_BUDGET:-6GiB}
REPEATS=${REPEATS:-3}
VERSIONS=${VERSIONS:-old main}
mkdir -p "$OUT" "$D"
grep -H . /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/kernel/mm/transparent_hugepage/enabled \
  > "$OUT/thp.txt" 2>&1 || true
N_DOT=$N_DOT N_MM=$N_MM D=$D python - <<'PY'
import os
from pathlib import Path

from mgpu.bench.outofcore import write_arrays

d, n_dot, n_mm = Path(os.environ["D"]), int(os.environ["N_DOT"]), int(os.environ["N_MM"])
write_arrays(d, {"x": (n_dot,), "y": (n_dot,)})
write_arrays(d, {"a": (n_mm, n_mm), "b": (n_mm, n_mm)})
PY
cat > "$D/dot.yaml" <<YAML
workload: dot
params: {input: {x: $D/x.npy, y: $D/y.npy}}
cluster: {memory_limit: $DOT_BUDGET, devices: 1, dashboard: null}
YAML
cat > "$D/mm.yaml" <<YAML
workload: matmul
params: {input: {a: $D/a.npy, b: $D/b.npy}, output: $D/c.npy, operands: streamed}
cluster: {memory_limit: $MM_BUDGET, devices: 1, dashboard: null}
force: true
YAML
for i in $(seq "$REPEATS"); do
  for v in $VERSIONS; do
    path=$PWD
    [ "$v" = main ] || path=$PWD/versions/$v
    # From the version's own folder: python -m puts the working folder first on the path.
    (cd "$path" && PYTHONPATH=$path python -m mgpu submit "$D/dot.yaml" -q --json "$OUT/dot-$v-$i.json")
    (cd "$path" && PYTHONPATH=$path python -m mgpu submit "$D/mm.yaml" -q --json "$OUT/mm-$v-$i.json")
  done
done
rm -rf "$D"
OUT=$OUT python - <<'PY'
import json
import os
from pathlib import Path

for f in sorted(Path(os.environ["OUT"]).glob("*.json")):
    r = json.loads(f.read_text())
    d = r["per_device"][0]
    t = (r.get("timeline") or [{}])[0]
    parts = " ".join(f"{k}={t[k]:.3f}" for k in ("products_s", "idle_s", "first_load_s", "write_tail_s") if k in t)
    print(
        f"{f.stem:14s} {r['throughput']['value']:8.2f} {r['throughput']['unit']:8s} compute_s={r['compute_s']:.3f}"
        f" busy_s={d['busy_s']:.3f} h2d_gbps={d['h2d_gbps'] or 0:.1f} {parts}"
    )
PY
