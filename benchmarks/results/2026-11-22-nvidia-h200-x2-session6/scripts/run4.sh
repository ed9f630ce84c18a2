set -x
R=$OUT/r4; mkdir -p $R/tl
timeout 100 python3 -m pytest -m gpu -q tests/test_gpu.py -k "distributed or file or npy or stag or peer" > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median" $R/tl/$name.txt; }
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192"
timeout 330 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -16 $R/oc.log
timeout 60 python3 benchmarks/outofcore.py $R/oc2 $OC --only mgpu-matmul,mgpu-dot > $R/oc2.log 2>&1
tail -8 $R/oc2.log
tl mm-files $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -f /dev/shm/oc/c-tl.npy
tl dot-files $R/oc/mgpu-dot.yaml
rm -rf /dev/shm/oc
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
