set -x
R=$OUT/r4; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -3 $R/in.log
# Locking the file's pages in pieces from many threads at once: does the driver's pinning scale?
timeout 240 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 64,256 --threads 4,16 \
  --methods pread,register-populate,register-split --json $R/probe.json > $R/probe.log 2>&1
tail -26 $R/probe.log
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
