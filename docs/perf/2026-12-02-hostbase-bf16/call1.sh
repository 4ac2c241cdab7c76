#!/usr/bin/env bash
# call 1: the 2B offload ratio side by side, the frozen base on the host on CUDA, the inference device tests
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl ut=/tmp/rt/bin/unit_tests final=$OUT out=/tmp/res1
mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
for o in none delayed; do
  a="parallel.offload_optimizer=cpu parallel.offload_update=$o"; [[ $o == none ]] && a="parallel.offload_optimizer=none"
  timeout 150 $q train input/bench_2b_gpu.deck $a checkpoint.every=0 run.out_dir=/tmp/runs/b_$o > $out/bench_dly_$o.log 2>&1
  say "bench_dly_$o: rc=$?"; cp /tmp/runs/b_$o/metrics.jsonl $out/bench_dly_$o.jsonl; rm -rf /tmp/runs/b_$o; pack
done
python3 - $out/bench_dly_none.jsonl $out/bench_dly_delayed.jsonl >> $out/summary.txt 2>&1 <<'PY'
import json, statistics, sys
n, d = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:3])
t = lambda r: statistics.median(x["time"]["step"] for x in r)
print(f"2B: GPU optimizer {t(n):.3f} s, offloaded+delayed {t(d):.3f} s: {t(d)/t(n):.3f}x (bound 1.15), tokens {n[0]['tokens']} {d[0]['tokens']}")
PY
pack
timeout 200 bash tools/gpu/train_checks.sh $q $ut /tmp/tc "hostbase"
cat /tmp/tc/summary.txt >> $out/summary.txt; tar xzf /tmp/tc/results.tgz -C $out 2>/dev/null; pack
Q3VL_REQUIRE_GPU=1 timeout 120 $ut --gtest_filter='BackendOps.*:DevInfer.*' > $out/unit_infer.log 2>&1
say "unit_infer: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit_infer.log | tr '\n' ' ')"
grep -E "^\[  FAILED" $out/unit_infer.log >> $out/summary.txt
pack
cat $out/summary.txt
