set -x
R=$OUT/b2; mkdir -p $R/tl
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 200 python3 benchmarks/outofcore.py $R/oc-pread $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot > $R/oc-pread.log 2>&1
tail -11 $R/oc-pread.log
DASK_MGPU__TRANSFER__READ=mmap timeout 80 python3 benchmarks/outofcore.py $R/oc-mmap $OC --only mgpu-matmul,mgpu-dot > $R/oc-mmap.log 2>&1
tail -9 $R/oc-mmap.log
for i in 1 2; do
timeout 40 python3 benchmarks/timeline.py $R/oc-pread/mgpu-dot.yaml --json $R/tl/dot-pread-$i.json > $R/tl/dot-pread-$i.txt 2>&1; head -1 $R/tl/dot-pread-$i.txt
DASK_MGPU__TRANSFER__READ=mmap timeout 40 python3 benchmarks/timeline.py $R/oc-pread/mgpu-dot.yaml --json $R/tl/dot-mmap-$i.json > $R/tl/dot-mmap-$i.txt 2>&1; head -1 $R/tl/dot-mmap-$i.txt
done
rm -rf /dev/shm/oc
cd $OUT && tar czf b2.tgz b2 && rm -rf b2
