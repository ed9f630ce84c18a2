set -x
R=$OUT/x8c; mkdir -p $R
timeout 200 python3 -m mgpu scale jobs/mandelbrot-64k.yaml --devices 1,2,4,8 --repeat 2 --no-dashboard --out $R/scale-mandelbrot-64k > $R/scale-mandelbrot-64k.log 2>&1
echo "rc $?"; grep "^| [0-9]" $R/scale-mandelbrot-64k/REPORT.md
cd $OUT && tar czf x8c.tgz x8c && rm -rf x8c
