#!/usr/bin/env bash
# call 1 (2026-12-02, fifth session): partial offload on the GPU (equalities, the 2B ratio side by side) and the
# loader's prefetch (2B, data.prefetch off against on)
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl ut=/tmp/rt/bin/unit_tests final=$OUT out=/tmp/res1
mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 420 bash tools/gpu/train_checks.sh $q $ut /tmp/tc "partial"
cat /tmp/tc/summary.txt >> $out/summary.txt; mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; pack
timeout 150 $q train input/bench_2b_gpu.deck data.prefetch=false checkpoint.every=0 run.out_dir=/tmp/runs/nopf > $out/bench_noprefetch.log 2>&1
say "bench_noprefetch: rc=$?"; cp /tmp/runs/nopf/metrics.jsonl $out/bench_noprefetch.jsonl; rm -rf /tmp/runs/nopf
python3 - $out/bench_noprefetch.jsonl $out/tc/bench_part_none.jsonl >> $out/summary.txt 2>&1 <<'PY'
import json, statistics, sys
n, p = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:3])
t = lambda r, k="step": statistics.median(x["time"][k] for x in r)
print(f"2B prefetch: off {t(n):.3f} s (data {t(n,'data'):.3f}), on {t(p):.3f} s (data {t(p,'data'):.3f}, build {statistics.median(x['time'].get('data_build',0) for x in p):.3f}): {t(n)/t(p):.3f}x; tok/s {statistics.median(x['tokens_per_s'] for x in n):.0f} -> {statistics.median(x['tokens_per_s'] for x in p):.0f}, mfu {statistics.median(x['mfu'] for x in p):.3f}")
PY
pack
cat $out/summary.txt
