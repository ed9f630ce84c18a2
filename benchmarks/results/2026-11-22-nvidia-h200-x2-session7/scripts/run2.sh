set -x
R=$OUT/r2; mkdir -p $R/tl $R/probe
# Mandelbrot bands (1 GPU, no Dask): today's run_tile against the session-6 check.
for v in "pool run_tile" "pool waiting-fetch" "pool run_tile"; do set -- $v
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/band_probe.py jobs/mandelbrot-64k.yaml --allocator $1 --check $2 \
    --json $R/probe/band-$1-$2.json > $R/probe/band-$1-$2.txt 2>&1; head -9 $R/probe/band-$1-$2.txt
done
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median\|panel" $R/tl/$name.txt; }
tl mb-2gpu-1 jobs/mandelbrot-64k.yaml
tl mb-2gpu-2 jobs/mandelbrot-64k.yaml
tl mb-1gpu jobs/mandelbrot-64k.yaml --set 'cluster.devices=[1]'
# Out of core: B panels now copied from a map (mgpu.transfer.read: auto), fetches after a stream wait.
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192 --xt-host pageable"
timeout 330 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -14 $R/oc.log
timeout 60 python3 benchmarks/outofcore.py $R/oc2 $OC --only mgpu-matmul,mgpu-dot > $R/oc2.log 2>&1
tail -8 $R/oc2.log
tl mm-files-1 $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -f /dev/shm/oc/c-tl.npy
DASK_MGPU__TRANSFER__READ=pread tl mm-files-pread $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
