#!/usr/bin/env bash
# call 2 (2026-12-03, ninth session), q3vl at 1886a5e (call 1's 714a8c6 + the one-block moe_plan, the paged combine
# over blocks again, the tensor-core GEMV's knobs by shape, the fp16 'wide' GEMV cases in range): the GPU suites,
# paged_check, gemv_bench, then the 8B at 1 stream (bf16 and fp8, profiled one row a step) and 64 streams, the
# 30B-A3B at 1 and 64 streams (the 1-row steps profiled).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res2 final=$OUT
rm -rf $out /tmp/results /tmp/sc_*; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
Q3VL_REQUIRE_GPU=1 timeout 170 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:Golden.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED|FAIL$" $out/unit.log | head >> $out/summary.txt; pack
timeout 60 /tmp/rt/bin/paged_check > $out/paged_check.txt 2>&1; say "paged_check rc=$? $((SECONDS-T0)) s"
grep -iE "fail" $out/paged_check.txt | head -5 >> $out/summary.txt; pack
timeout 100 /tmp/rt/bin/gemv_bench > $out/gemv_bench.txt 2>&1; say "gemv_bench rc=$? $((SECONDS-T0)) s"
grep -E "FAIL" $out/gemv_bench.txt | head -5 >> $out/summary.txt; tail -2 $out/gemv_bench.txt >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 8b 8b "1 64" 110 PROFILE=2 PROFILE_ROWS=1
rem=$((450 - SECONDS + T0)); ((rem > 100)) && run 30b 30b "1 64" $rem PROFILE=2 PROFILE_ROWS=1
rem=$((520 - SECONDS + T0)); ((rem > 50)) && run 8bfp8 8bfp8 1 $rem PROFILE=2 PROFILE_ROWS=1
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
