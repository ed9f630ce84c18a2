set -x
R=$OUT/a; mkdir -p $R/tl
nvidia-smi topo -m > $R/topo.txt 2>&1
timeout 150 python3 -m pytest -m gpu -q tests/test_gpu.py -k "in_order or bands_check or stag or file or npy or mandelbrot" > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
# The new GPU test's check with every stream at one priority (the old streams): does the check wait?
timeout 60 python3 - > $R/flat-priority.txt 2>&1 <<'PY'
import sys; sys.path.insert(0, "tests")
import cupy
from test_gpu import check_wait_behind_next_band
from mgpu.device import Device, DeviceFacts
from mgpu.plugins import _cuda_device
flat = Device("cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True))
for name, dev in (("flat", flat), ("mgpu", _cuda_device())):
    for _ in range(3):
        print(name, "check waited %.2f ms, second kernel %.2f ms" % check_wait_behind_next_band(dev))
PY
cat $R/flat-priority.txt
tl() { name=$1; shift; timeout 40 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "Giter\|GB/s\|TFLOP" $R/tl/$name.txt; }
for i in 1 2 3; do tl mb-2gpu-$i jobs/mandelbrot-64k.yaml; done
for i in 1 2; do tl mb-1gpu-$i jobs/mandelbrot-64k.yaml --set 'cluster.devices=[1]'; done
tl mb-f64-2gpu jobs/mandelbrot-64k.yaml --set params.dtype=float64
for i in 1 2; do timeout 40 python3 -c "
import runpy, sys, mgpu.runner as r
r._DYNAMIC_AHEAD = 8
sys.argv = ['timeline.py', 'jobs/mandelbrot-64k.yaml', '--json', '$R/tl/mb-2gpu-ahead8-$i.json']
runpy.run_path('benchmarks/timeline.py', run_name='__main__')" > $R/tl/mb-2gpu-ahead8-$i.txt 2>&1; grep -h Giter $R/tl/mb-2gpu-ahead8-$i.txt; done
OC="--n 49152 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --keep"
timeout 240 python3 benchmarks/outofcore.py $R/oc-pread $OC --only inputs,ceilings,mgpu-matmul,mgpu-dot > $R/oc-pread.log 2>&1
tail -14 $R/oc-pread.log
DASK_MGPU__TRANSFER__READ=mmap timeout 80 python3 benchmarks/outofcore.py $R/oc-mmap $OC --only ceilings,mgpu-matmul,mgpu-dot > $R/oc-mmap.log 2>&1
tail -10 $R/oc-mmap.log
timeout 80 python3 benchmarks/outofcore.py $R/oc-pread2 $OC --only ceilings,mgpu-matmul,mgpu-dot > $R/oc-pread2.log 2>&1
tail -10 $R/oc-pread2.log
tl dot-files-pread $R/oc-pread/mgpu-dot.yaml
DASK_MGPU__TRANSFER__READ=mmap tl dot-files-mmap $R/oc-pread/mgpu-dot.yaml
tl mm-files-pread $R/oc-pread/mgpu-matmul.yaml --set params.output=/dev/shm/oc/c-tl.npy
rm -rf /dev/shm/oc
cd $OUT && tar czf a.tgz a && rm -rf a
