set -x
source .whl/env.sh
R=$OUT/r4; mkdir -p $R/tl
timeout 120 python3 benchmarks/stager_probe.py /dev/shm/sp --gib 4 --json $R/stager-probe.json > $R/stager-probe.log 2>&1
rm -rf /dev/shm/sp
for i in 1 2; do timeout 40 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --json $R/tl/mb-f32-2gpu-$i.json > $R/tl/mb-f32-2gpu-$i.txt 2>&1; done
timeout 40 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --set 'cluster.devices=[1]' --json $R/tl/mb-f32-1gpu.json > $R/tl/mb-f32-1gpu.txt 2>&1
timeout 40 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --set params.dtype=float64 --json $R/tl/mb-f64-2gpu.json > $R/tl/mb-f64-2gpu.txt 2>&1
timeout 200 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
timeout 100 python3 -m pytest -m gpu -q -x tests/test_gpu.py -k "mandelbrot or in_order or staged or from_files" > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tail -18 $R/suite.log
grep -h "Giter\|span" $R/tl/*.txt
cat $R/stager-probe.log | tail -40
cd $OUT && tar czf r4.tgz r4 && rm -rf r4
