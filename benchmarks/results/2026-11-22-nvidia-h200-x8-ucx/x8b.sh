set -x
R=$OUT/x8b; mkdir -p $R
run() { name=$1; shift; timeout $T python3 -m mgpu scale "$@" --devices 1,2,4,8 --repeat 2 --set cluster.protocol=ucx --no-dashboard --out $R/scale-$name > $R/scale-$name.log 2>&1; echo "$name rc $?" >> $R/x8.log; grep "^| [0-9]" $R/scale-$name/REPORT.md >> $R/x8.log; }
T=170 run mandelbrot-64k jobs/mandelbrot-64k.yaml
T=170 run dot-20g jobs/dot-2g.yaml --set params.n=20000000000
CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -m gpu -q -x tests/test_gpu.py -k "stag or file or transfer or npy" > $R/gpu-tests-staging.log 2>&1; echo "tests rc $?" >> $R/x8.log; tail -3 $R/gpu-tests-staging.log >> $R/x8.log
cat $R/x8.log
cd $OUT && tar czf x8b.tgz x8b && rm -rf x8b
