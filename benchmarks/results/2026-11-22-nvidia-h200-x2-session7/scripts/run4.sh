set -x
R=$OUT/r4; mkdir -p $R/tl
timeout 120 python3 -m pytest -m gpu -q tests/test_gpu.py -k "distributed or file or npy or stag or peer" > $R/gpu-tests.log 2>&1
tail -2 $R/gpu-tests.log
# A new tmpfs file read three times over: is the first read after writing slower?
python3 -c "import numpy as np; m = np.lib.format.open_memmap('/dev/shm/probe.npy', mode='w+', dtype=np.float32, shape=(2**31,)); m[:] = 1; m.flush()"
for i in 1 2 3; do /usr/bin/time -f "cat of an 8 GiB tmpfs file, read $i: %e s" cat /dev/shm/probe.npy > /dev/null; done 2>&1 | tee $R/reads.txt
rm -f /dev/shm/probe.npy
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|GB/s\|median\|vm:" $R/tl/$name.txt; }
# Out of core: three tiles at once per GPU (session 7), cuBLASXt in the same run.
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192 --xt-host pageable"
timeout 330 python3 benchmarks/outofcore.py $R/oc $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc.log 2>&1
tail -14 $R/oc.log
for i in 2 3 4; do
  timeout 60 python3 benchmarks/outofcore.py $R/oc$i $OC --only mgpu-matmul,mgpu-dot > $R/oc$i.log 2>&1
  grep -h "mgpu matmul\|mgpu dot" $R/oc$i.log
done
tl mm-files $R/oc/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
