set -x
source .whl/env.sh
R=$OUT/r5; mkdir -p $R/tl
timeout 130 python3 -m pytest -m gpu -q tests/test_gpu.py > $R/gpu-tests.log 2>&1
for i in 1 2 3; do
DASK_MGPU__WORKER__GC_FREEZE=False timeout 30 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --json $R/tl/nofreeze-$i.json > $R/tl/nofreeze-$i.txt 2>&1
timeout 30 python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --json $R/tl/freeze-$i.json > $R/tl/freeze-$i.txt 2>&1
done
timeout 80 python3 -m mgpu scale jobs/mandelbrot-64k.yaml --devices 1,2 --repeat 3 --no-dashboard --out $R/scale-mandelbrot-64k > $R/scale-mandelbrot.log 2>&1
timeout 80 python3 benchmarks/outofcore.py $R/oc --n 4096 --budget 16GiB --devices 0,1 --scratch /dev/shm/oc --dot-n 4400000000 --only inputs,mgpu-dot --keep > $R/oc.log 2>&1
timeout 30 python3 benchmarks/timeline.py $R/oc/mgpu-dot.yaml --json $R/tl/dot-files.json > $R/tl/dot-files.txt 2>&1
tail -3 $R/gpu-tests.log
for f in $R/tl/*freeze-*.txt; do echo $f; grep -h "Giter\|span" $f; done
grep "^| [0-9]" $R/scale-mandelbrot-64k/REPORT.md
tail -6 $R/oc.log; cat $R/tl/dot-files.txt | tail -5
cd $OUT && tar czf r5.tgz r5 && rm -rf r5
