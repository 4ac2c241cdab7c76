#!/usr/bin/env bash
# call 2 (2026-12-02, seventh session), binaries at 19270b0: the grouped GEMM harness after the A/B switch removal;
# the 2B step against transformers (wgmma attention backward); 8B serving at 1 and 64 streams with step profiles
# (paged attention on tensor cores, batched vision); the 30B-A3B shape cut to 6 layers against transformers.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res2 final=$OUT; mkdir -p $out
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 90 /tmp/rt/bin/moe_bench 20 > $out/moe.txt 2>&1; say "moe_bench rc=$? $((SECONDS-T0)) s"; grep -E "FAIL|wgmma" $out/moe.txt | head -5 >> $out/summary.txt; tail -10 $out/moe.txt >> $out/summary.txt; pack
timeout 200 bash tools/gpu/train_checks.sh $q none /tmp/tc "hftrain"
mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; cat /tmp/tc/summary.txt >> $out/summary.txt; say "hftrain done $((SECONDS-T0)) s"; pack
CONC="1 64" PROFILE=2 timeout 170 bash tools/gpu/serve_checks.sh $q none /tmp/sc8 "8b"
mkdir -p $out/sc8; tar xzf /tmp/sc8/results.tgz -C $out/sc8 2>/dev/null; grep -v "^ " /tmp/sc8/summary.txt >> $out/summary.txt; say "8b done $((SECONDS-T0)) s"; pack
rem=$((585 - SECONDS + T0)); ((rem > 60)) && timeout $rem bash tools/gpu/train_checks.sh $q none /tmp/tm "moe"
mkdir -p $out/tm; tar xzf /tmp/tm/results.tgz -C $out/tm 2>/dev/null; cat /tmp/tm/summary.txt >> $out/summary.txt 2>/dev/null
say "done $((SECONDS-T0)) s"; pack
cat $out/summary.txt | cut -c1-400; grep -h "engine over" $out/sc8/*.txt 2>/dev/null
