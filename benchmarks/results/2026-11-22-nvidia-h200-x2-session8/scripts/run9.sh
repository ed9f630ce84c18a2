set -x
R=$OUT/r9; mkdir -p $R
# After the review's mend (the read alone through FileBlock.fill, one pool per thread count): does the probe still run?
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 1000000000 --keep"
timeout 200 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
timeout 120 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --methods pread --chunks 16 \
  --threads 8,16 --repeat 1 --json $R/probe.json > $R/probe.log 2>&1
tail -10 $R/probe.log
rm -rf /dev/shm/oc
cd $OUT && tar czf r9.tgz r9 && rm -rf r9
