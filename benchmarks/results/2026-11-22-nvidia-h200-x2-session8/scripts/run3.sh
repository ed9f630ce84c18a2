set -x
R=$OUT/r3; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -3 $R/in.log
# The copy-free route (the file's pages locked in place) against the staged one, with the ceilings.
timeout 240 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 16,64 \
  --methods pread,register,register-populate --json $R/probe.json > $R/probe.log 2>&1
tail -20 $R/probe.log
cd $OUT && tar czf r3.tgz r3 && rm -rf r3
