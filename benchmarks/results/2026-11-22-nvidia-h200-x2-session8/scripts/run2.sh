set -x
R=$OUT/r2; mkdir -p $R
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs > $R/in.log 2>&1
tail -3 $R/in.log
# The host's routes from the job's files to both GPUs at once, no Dask, with the ceilings.
timeout 240 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 16,32,64 \
  --threads 16,24 --json $R/probe.json > $R/probe.log 2>&1
tail -32 $R/probe.log
dot() { tag=$1; shift; env "$@" timeout 90 python3 benchmarks/outofcore.py $R/dot-$tag $OC --only mgpu-dot > $R/dot-$tag.log 2>&1; echo "$tag: $(grep -h 'mgpu dot' $R/dot-$tag.log | cut -c1-60)"; }
dot pread16
dot pread32 DASK_MGPU__TRANSFER__CHUNK_BYTES=33554432
dot pread64 DASK_MGPU__TRANSFER__CHUNK_BYTES=67108864
dot pread16t24 DASK_MGPU__TRANSFER__HOST_THREADS=24
dot pread64t24 DASK_MGPU__TRANSFER__HOST_THREADS=24 DASK_MGPU__TRANSFER__CHUNK_BYTES=67108864
dot pread16b
dot pread64b DASK_MGPU__TRANSFER__CHUNK_BYTES=67108864
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
