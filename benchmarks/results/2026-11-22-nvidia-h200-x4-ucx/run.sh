set -x
source .whl/env.sh
R=$OUT/x4ucx; mkdir -p $R
nvidia-smi topo -m > $R/topo.txt 2>&1
nvidia-smi -L >> $R/topo.txt
timeout 100 python3 -m mgpu submit jobs/matmul.yaml --set cluster.protocol=ucx --set 'cluster.devices=[0,1]' --no-dashboard --json $R/smoke-ucx.json > $R/smoke-ucx.log 2>&1
echo "smoke rc $?" | tee -a $R/x4.log
grep -q '"status": "ok"' $R/smoke-ucx.json || { tail -40 $R/smoke-ucx.log; cd $OUT && tar czf x4ucx.tgz x4ucx; exit 1; }
run() { name=$1; shift; timeout $T python3 -m mgpu scale "$@" --devices 1,2,4 --repeat 2 --set cluster.protocol=ucx --no-dashboard --out $R/scale-$name > $R/scale-$name.log 2>&1; echo "$name rc $?" >> $R/x4.log; grep "^| [0-9]" $R/scale-$name/REPORT.md >> $R/x4.log; }
T=150 run matmul-32k jobs/matmul-32k.yaml
T=120 run mandelbrot-64k jobs/mandelbrot-64k.yaml
T=120 run dot-20g jobs/dot-2g.yaml --set params.n=20000000000
T=170 run matmul-64k jobs/matmul-32k.yaml --set params.m=65536 --set params.n=65536 --set params.k=65536
cat $R/x4.log
cd $OUT && tar czf x4ucx.tgz x4ucx && rm -rf x4ucx
