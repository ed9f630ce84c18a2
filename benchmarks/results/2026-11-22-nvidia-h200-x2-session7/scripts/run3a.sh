set -x
R=$OUT/r3a; mkdir -p $R/tl
cache() { echo "$1: cupy kernel cache $(ls ~/.cupy/kernel_cache 2>/dev/null | wc -l) files, nv ComputeCache $(du -sk ~/.nv/ComputeCache 2>/dev/null | cut -f1) KB"; }
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median\|in tasks" $R/tl/$name.txt; }
# float64 matmul, three times from a fresh machine: is the slow first run a first-use cost?
cache start
tl mm-f64-1 jobs/matmul-32k-f64.yaml; cache after-1
tl mm-f64-2 jobs/matmul-32k-f64.yaml; cache after-2
tl mm-f64-3 jobs/matmul-32k-f64.yaml
timeout 200 python3 -m pytest -m gpu -q tests/test_gpu.py > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tl mb-2gpu-1 jobs/mandelbrot-64k.yaml
tl mb-2gpu-2 jobs/mandelbrot-64k.yaml
timeout 330 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
tail -22 $R/suite.log
cd $OUT && tar czf r3a.tgz r3a && rm -rf r3a
