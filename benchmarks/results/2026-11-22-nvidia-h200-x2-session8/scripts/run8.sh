set -x
R=$OUT/r8; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -2 $R/in.log
# The read alone on mgpu's pool (its pinned buffers made before the clock; r2-r7 made them inside it).
timeout 200 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --methods pread --chunks 16 \
  --repeat 3 --json $R/probe.json > $R/probe.log 2>&1
tail -8 $R/probe.log
timeout 90 python3 benchmarks/outofcore.py $R/dot $OC --only mgpu-dot > $R/dot.log 2>&1
grep -a "mgpu dot" $R/dot.log | cut -c1-70
rm -rf /dev/shm/oc
cd $OUT && tar czf r8.tgz r8 && rm -rf r8
