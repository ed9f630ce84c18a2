set -x
R=$OUT/r1; mkdir -p $R/tl
nvidia-smi topo -m > $R/topo.txt 2>&1; lscpu > $R/lscpu.txt 2>&1; free -g > $R/free.txt; df -h /dev/shm >> $R/free.txt
timeout 120 python3 -m pytest -m gpu -q tests/test_gpu.py -k "stag or file or npy" > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
# Host routes: one process, then two at once (one per GPU, as two workers).
timeout 150 python3 benchmarks/host_io.py /dev/shm/hio --gib 2 --json $R/host-io-1proc.json > $R/host-io-1proc.txt 2>&1
grep -h "pwrite\|new_mmap\|registered_pieces\|memcpy\|readinto_pinned_16\|fresh_mmap_to_pinned_16" $R/host-io-1proc.txt
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/host_io.py /dev/shm/hio0 --gib 2 --json $R/host-io-2proc-0.json > $R/host-io-2proc-0.txt 2>&1 &
 CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/host_io.py /dev/shm/hio1 --gib 2 --json $R/host-io-2proc-1.json > $R/host-io-2proc-1.txt 2>&1; wait)
grep -h "pwrite_16\|new_mmap_16\|registered_pieces\|memcpy_pageable_32" $R/host-io-2proc-*.txt
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median" $R/tl/$name.txt; }
# f64 matmul: where its tiles' 0.13 s off the GEMM goes (2 GPUs, then 1), and without the check.
tl mm-f64-2gpu-1 jobs/matmul-32k-f64.yaml
tl mm-f64-2gpu-2 jobs/matmul-32k-f64.yaml
tl mm-f64-2gpu-noverify jobs/matmul-32k-f64.yaml --set verify=false
tl mm-f64-1gpu jobs/matmul-32k-f64.yaml --set 'cluster.devices=[1]'
tl mb-2gpu-1 jobs/mandelbrot-64k.yaml
tl mb-2gpu-2 jobs/mandelbrot-64k.yaml
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep --xt-blocks 8192"
timeout 300 python3 benchmarks/outofcore.py $R/oc-pwrite $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot,cublasxt > $R/oc-pwrite.log 2>&1
tail -16 $R/oc-pwrite.log
DASK_MGPU__TRANSFER__WRITE=mmap timeout 60 python3 benchmarks/outofcore.py $R/oc-mmap $OC --only mgpu-matmul > $R/oc-mmap.log 2>&1
tail -6 $R/oc-mmap.log
timeout 60 python3 benchmarks/outofcore.py $R/oc-pwrite2 $OC --only mgpu-matmul > $R/oc-pwrite2.log 2>&1
tail -6 $R/oc-pwrite2.log
tl mm-files-pwrite $R/oc-pwrite/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -f /dev/shm/oc/c-tl.npy
DASK_MGPU__TRANSFER__WRITE=mmap tl mm-files-mmap $R/oc-pwrite/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc /dev/shm/hio*
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
