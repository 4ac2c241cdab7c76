#!/usr/bin/env bash
# call 3 (2026-12-02, fifth session): the 8B shape at 64 streams with and without serve.max_tpot_ms = 14; the 2B
# training step against transformers in the same call (with the loader's prefetch)
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl ut=/tmp/rt/bin/unit_tests final=$OUT out=/tmp/res3
mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
nvidia-smi -L > $out/summary.txt
CONC=64 timeout 260 bash tools/gpu/serve_checks.sh $q $ut /tmp/sc "8b 8btpot" &
sc=$!
while kill -0 $sc 2>/dev/null; do sleep 15; mkdir -p $out/sc; tar xzf /tmp/sc/results.tgz -C $out/sc 2>/dev/null; cp /tmp/sc/summary.txt $out/sc_summary.txt 2>/dev/null; pack; done
mkdir -p $out/sc; tar xzf /tmp/sc/results.tgz -C $out/sc 2>/dev/null; cat /tmp/sc/summary.txt >> $out/summary.txt; pack
timeout 280 bash tools/gpu/train_checks.sh $q $ut /tmp/tc "hftrain" &
tc=$!
while kill -0 $tc 2>/dev/null; do sleep 15; mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; pack; done
mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; cat /tmp/tc/summary.txt >> $out/summary.txt; pack
cat $out/summary.txt
