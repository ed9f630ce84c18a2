set -x
R=$OUT/r3b; mkdir -p $R/tl
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median\|panel" $R/tl/$name.txt; }
# Out of core: B panels in two column pieces each (session 7), read from a map; cuBLASXt in the same run.
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192 --xt-host pageable"
timeout 330 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -14 $R/oc.log
for i in 2 3; do
  timeout 60 python3 benchmarks/outofcore.py $R/oc$i $OC --only mgpu-matmul,mgpu-dot > $R/oc$i.log 2>&1
  grep -h "mgpu matmul\|mgpu dot" $R/oc$i.log
done
tl mm-files $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc
cd $OUT && tar czf r3b.tgz r3b && rm -rf r3b
