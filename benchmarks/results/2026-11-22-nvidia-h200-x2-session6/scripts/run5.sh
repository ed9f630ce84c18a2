set -x
R=$OUT/r5; mkdir -p $R
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 150 python3 benchmarks/outofcore.py $R/oc1 $OC --only inputs,ceilings,mgpu-matmul > $R/oc1.log 2>&1
grep "mgpu matmul" $R/oc1.log
for i in 2 3 4; do
timeout 40 python3 benchmarks/outofcore.py $R/oc$i $OC --only mgpu-matmul > $R/oc$i.log 2>&1
grep "mgpu matmul" $R/oc$i.log
done
rm -rf /dev/shm/oc
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
