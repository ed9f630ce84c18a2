set -x
R=$OUT/x8a; mkdir -p $R
nvidia-smi topo -m > $R/topo.txt 2>&1
nvidia-smi -L >> $R/topo.txt
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >> $R/topo.txt
nproc >> $R/topo.txt; free -g >> $R/topo.txt
timeout 100 python3 -m mgpu submit jobs/matmul.yaml --set cluster.protocol=ucx --no-dashboard --json $R/smoke-ucx.json > $R/smoke-ucx.log 2>&1
echo "smoke rc $?" | tee -a $R/x8.log
grep -q '"status": "ok"' $R/smoke-ucx.json || { tail -40 $R/smoke-ucx.log; cd $OUT && tar czf x8a.tgz x8a; exit 1; }
run() { name=$1; shift; timeout $T python3 -m mgpu scale "$@" --devices 1,2,4,8 --repeat 2 --set cluster.protocol=ucx --no-dashboard --out $R/scale-$name > $R/scale-$name.log 2>&1; echo "$name rc $?" >> $R/x8.log; grep "^| [0-9]" $R/scale-$name/REPORT.md >> $R/x8.log; }
T=190 run matmul-32k jobs/matmul-32k.yaml
T=260 run matmul-64k jobs/matmul-32k.yaml --set params.m=65536 --set params.n=65536 --set params.k=65536
cat $R/x8.log
cd $OUT && tar czf x8a.tgz x8a && rm -rf x8a
