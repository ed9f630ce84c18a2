set -x
source .whl/env.sh
R=$OUT/r3; mkdir -p $R/tl
timeout 300 python3 benchmarks/outofcore.py $R/oc --n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/mgpu-oc --dot-n 4400000000 --xt-blocks 8192 --keep > $R/oc.log 2>&1
DASK_MGPU__TRANSFER__HOST_THREADS=8 timeout 60 python3 benchmarks/outofcore.py $R/oc8 --n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/mgpu-oc --dot-n 4400000000 --only mgpu-matmul,mgpu-dot --keep > $R/oc8.log 2>&1
rm -rf /dev/shm/mgpu-oc
for i in 1 2; do timeout 40 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --json $R/tl/mb-f32-2gpu-$i.json > $R/tl/mb-f32-2gpu-$i.txt 2>&1; done
timeout 40 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --set 'cluster.devices=[1]' --json $R/tl/mb-f32-1gpu.json > $R/tl/mb-f32-1gpu.txt 2>&1
timeout 200 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
timeout 150 python3 -m pytest -m gpu -q -x tests/test_gpu.py > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tail -18 $R/suite.log
grep -h "Giter\|span" $R/tl/*.txt
tail -25 $R/oc.log; tail -8 $R/oc8.log
cd $OUT && tar czf r3.tgz r3 && rm -rf r3
