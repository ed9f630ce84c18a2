set -x
R=$OUT/r6; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -2 $R/in.log
# The GPU reading the file's map in place (HMM), where the driver allows it.
timeout 200 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 16 \
  --methods pread,hmm --repeat 1 --json $R/probe.json > $R/probe.log 2>&1
tail -8 $R/probe.log
cd $OUT && tar czf r6.tgz r6 && rm -rf r6
