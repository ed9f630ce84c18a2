set -x
R=$OUT/r5; mkdir -p $R
# The landed code: inputs read once untimed after writing, then mgpu and cuBLASXt in one run.
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192 --xt-host pageable"
timeout 360 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -15 $R/oc.log
timeout 60 python3 benchmarks/outofcore.py $R/oc2 $OC --only mgpu-matmul,mgpu-dot > $R/oc2.log 2>&1
grep -h "mgpu matmul\|mgpu dot" $R/oc2.log
rm -rf /dev/shm/oc
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
