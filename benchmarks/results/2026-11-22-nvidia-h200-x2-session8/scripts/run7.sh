set -x
R=$OUT/r7; mkdir -p $R
# The code landed: GPU tests of staging, files and dot, then the out-of-core benchmark with the host routes.
timeout 150 python3 -m pytest -m gpu -q tests/test_gpu.py tests/test_outofcore_bench.py -k "stag or file or npy or dot or transfer or outofcore or xt" > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192 --xt-host pageable"
timeout 420 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,host-routes,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -24 $R/oc.log
rm -rf /dev/shm/oc
cd $OUT && tar czf r7.tgz r7 && rm -rf r7
