set -x
R=$OUT/r1; mkdir -p $R/tl $R/probe
# Mandelbrot: where a band's thread waits before its kernel is queued (1 GPU, no Dask).
for v in "pool sync" "pool deferred" "cupy sync" "async sync"; do set -- $v
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/band_probe.py jobs/mandelbrot-64k.yaml --allocator $1 --check $2 \
    --json $R/probe/band-$1-$2.json > $R/probe/band-$1-$2.txt 2>&1; head -14 $R/probe/band-$1-$2.txt
done
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median\|panel" $R/tl/$name.txt; }
# Out-of-core matmul: the panels' spans and rates before the first tile.
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 100000000 --keep --xt-blocks 8192"
timeout 200 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul > $R/oc.log 2>&1
tail -10 $R/oc.log
tl mm-files-1 $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -f /dev/shm/oc/c-tl.npy
tl mm-files-2 $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc
tl mm-f64-1 jobs/matmul-32k-f64.yaml
tl mm-f64-2 jobs/matmul-32k-f64.yaml
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
