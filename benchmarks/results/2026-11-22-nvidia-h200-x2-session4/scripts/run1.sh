set -x
source .whl/env.sh
R=$OUT/r1; mkdir -p $R/tl
nvidia-smi topo -m > $R/topo.txt 2>&1; nproc >> $R/topo.txt; free -g >> $R/topo.txt
python3 benchmarks/host_io.py /dev/shm/hio0 --gib 4 --json $R/host-io-1proc.json > $R/host-io-1proc.txt 2>&1
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/host_io.py /dev/shm/hio0 --gib 4 --json $R/host-io-2proc-0.json > $R/host-io-2proc-0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 benchmarks/host_io.py /dev/shm/hio1 --gib 4 --json $R/host-io-2proc-1.json > $R/host-io-2proc-1.txt 2>&1 &
wait
rm -rf /dev/shm/hio*
for i in 1 2; do
python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --json $R/tl/mb-f32-2gpu-$i.json > $R/tl/mb-f32-2gpu-$i.txt 2>&1
done
python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --set 'cluster.devices=[1]' --json $R/tl/mb-f32-1gpu.json > $R/tl/mb-f32-1gpu.txt 2>&1
python3 benchmarks/timeline.py jobs/mandelbrot-64k.yaml --set params.dtype=float64 --json $R/tl/mb-f64-2gpu.json > $R/tl/mb-f64-2gpu.txt 2>&1
timeout 200 python3 benchmarks/gpu_suite.py $R/suite > $R/suite.log 2>&1
timeout 170 python3 -m pytest -m gpu -q -x tests/test_gpu.py > $R/gpu-tests.log 2>&1
tail -3 $R/gpu-tests.log
tail -20 $R/suite.log
grep -h "Giter\|span" $R/tl/*.txt | head -20
cat $R/host-io-1proc.txt
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
