set -x
R=$OUT/r5; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -2 $R/in.log
# Both routes at once: the front of each span staged by the host threads, the back locked in place.
timeout 300 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 64,256 \
  --methods pread,hybrid --splits 0.4,0.5,0.6 --json $R/probe.json > $R/probe.log 2>&1
tail -20 $R/probe.log
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
