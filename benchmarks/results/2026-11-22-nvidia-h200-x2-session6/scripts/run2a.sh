set -x
R=$OUT/r2a; mkdir -p $R/tl
timeout 200 python3 -m pytest -m gpu -q tests/test_gpu.py > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tl() { name=$1; shift; timeout 60 python3 benchmarks/timeline.py "$@" --json $R/tl/$name.json > $R/tl/$name.txt 2>&1; grep -h "TFLOP\|Giter\|GB/s\|median" $R/tl/$name.txt; }
tl mb-2gpu-1 jobs/mandelbrot-64k.yaml
tl mb-2gpu-2 jobs/mandelbrot-64k.yaml
tl mb-2gpu-async jobs/mandelbrot-64k.yaml --set cluster.allocator=async
timeout 330 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
tail -20 $R/suite.log
cd $OUT && tar czf r2a.tgz r2a && rm -rf r2a
