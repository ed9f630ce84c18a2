set -x
R=$OUT/r1; mkdir -p $R
uname -r; nproc; free -g | head -2
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv
# Dot inputs only (A and B tiny): x and y of 4.4e9 float32, 17.6 GB each, on tmpfs.
OC="--n 2048 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/in $OC --only inputs,ceilings > $R/in.log 2>&1
tail -5 $R/in.log; ls -la /dev/shm/oc
# The host's routes from the job's files to both GPUs at once, no Dask.
timeout 200 python3 benchmarks/gpus_from_files.py /dev/shm/oc/x.npy /dev/shm/oc/y.npy --chunks 1,4,16 \
  --json $R/probe.json > $R/probe.log 2>&1
cat $R/probe.log | tail -25
# The dot job itself by read method and chunk size.
dot() { tag=$1; shift; env "$@" timeout 90 python3 benchmarks/outofcore.py $R/dot-$tag $OC --only mgpu-dot > $R/dot-$tag.log 2>&1; echo "$tag: $(grep -h 'mgpu dot' $R/dot-$tag.log)"; }
dot pread16 DASK_MGPU__TRANSFER__READ=pread
dot mmap16 DASK_MGPU__TRANSFER__READ=mmap
dot pread1 DASK_MGPU__TRANSFER__READ=pread DASK_MGPU__TRANSFER__CHUNK_BYTES=1048576
dot mmap1 DASK_MGPU__TRANSFER__READ=mmap DASK_MGPU__TRANSFER__CHUNK_BYTES=1048576
dot pop1 DASK_MGPU__TRANSFER__READ=mmap DASK_MGPU__TRANSFER__POPULATE=True DASK_MGPU__TRANSFER__CHUNK_BYTES=1048576
dot pread4 DASK_MGPU__TRANSFER__READ=pread DASK_MGPU__TRANSFER__CHUNK_BYTES=4194304
dot mmap4 DASK_MGPU__TRANSFER__READ=mmap DASK_MGPU__TRANSFER__CHUNK_BYTES=4194304
dot pread16b DASK_MGPU__TRANSFER__READ=pread
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
