#!/usr/bin/env bash
# call 2 (2026-12-03, eighth session), q3vl at 19270b0 (the seventh session's serving code): where one stream's decode
# step goes (8B bf16 and fp8, serve.profile_rows = 1: every step of one row profiled op by op) and the 30B-A3B shape
# at 1 and 64 streams (not measured since the paged attention on tensor cores and the batched vision).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res2 final=$OUT; mkdir -p $out
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
for p in 8b 8bfp8; do
  CONC="1" PROFILE=2 PROFILE_ROWS=1 timeout 80 bash tools/gpu/serve_checks.sh $q none /tmp/sc_$p "$p"
  mkdir -p $out/$p; tar xzf /tmp/sc_$p/results.tgz -C $out/$p 2>/dev/null; grep -v "^ " /tmp/sc_$p/summary.txt >> $out/summary.txt
  say "$p done $((SECONDS-T0)) s"; pack
done
rem=$((330 - SECONDS + T0)); ((rem > 60)) && CONC="1 64" timeout $rem bash tools/gpu/serve_checks.sh $q none /tmp/sc_30b "30b"
mkdir -p $out/30b; tar xzf /tmp/sc_30b/results.tgz -C $out/30b 2>/dev/null; grep -v "^ " /tmp/sc_30b/summary.txt >> $out/summary.txt 2>/dev/null
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
