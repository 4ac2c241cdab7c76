#!/usr/bin/env bash
# call 2 (2026-12-02, fifth session): the 235B LoRA cut with the base on the host in bf16 against the plan; the serving
# engine split on CUDA (device suites, generate on CUDA, serve on CUDA against generate); the 8B shape in fp8
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl ut=/tmp/rt/bin/unit_tests final=$OUT out=/tmp/res2
mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
nvidia-smi -L > $out/summary.txt
BIG=235b timeout 200 bash tools/gpu/train_checks.sh $q $ut /tmp/tc "big"
cat /tmp/tc/summary.txt >> $out/summary.txt; mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; pack
timeout 330 bash tools/gpu/serve_checks.sh $q $ut /tmp/sc "unit gencuda tiny 8bfp8" &
sc=$!
while kill -0 $sc 2>/dev/null; do sleep 15; mkdir -p $out/sc; tar xzf /tmp/sc/results.tgz -C $out/sc 2>/dev/null; cp /tmp/sc/summary.txt $out/sc_summary.txt 2>/dev/null; pack; done
mkdir -p $out/sc; tar xzf /tmp/sc/results.tgz -C $out/sc 2>/dev/null; cat /tmp/sc/summary.txt >> $out/summary.txt; pack
cat $out/summary.txt
