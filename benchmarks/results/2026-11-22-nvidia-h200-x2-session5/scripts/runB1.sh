set -x
R=$OUT/b1; mkdir -p $R
timeout 200 python3 -m pytest -m gpu -q tests/test_gpu.py > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
timeout 60 python3 - > $R/priority-check.txt 2>&1 <<'PY'
import sys; sys.path.insert(0, "tests")
import cupy
from test_gpu import check_wait_behind_next_band
from mgpu.device import Device, DeviceFacts
from mgpu.plugins import _cuda_device
flat = Device("cuda", cupy, DeviceFacts("cuda", 0, "gpu", 1, 1, "h"), new_stream=lambda: cupy.cuda.Stream(non_blocking=True))
for name, dev in (("one priority", flat), ("mgpu's streams", _cuda_device())):
    for _ in range(3):
        print(name, "check waited %.2f ms, second kernel %.2f ms" % check_wait_behind_next_band(dev))
PY
cat $R/priority-check.txt
timeout 60 python3 benchmarks/pcie_at_once.py --json $R/pcie-at-once.json > $R/pcie-at-once.txt 2>&1; cat $R/pcie-at-once.txt
timeout 280 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
tail -25 $R/suite.log
cd $OUT && tar czf b1.tgz b1 && rm -rf b1
