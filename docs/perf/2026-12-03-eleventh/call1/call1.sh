#!/usr/bin/env bash
# call 1 (2026-12-03, eleventh session): programmatic dependent launch (PDL) of the decode GEMV and the small decode
# kernels, the GEMV's early L2 prefetch: the GPU suites, and one stream served with Q3VL_PDL=0 against PDL on (8B fp8, 8B bf16 with the dense GEMV, 30B-A3B).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res1 final=$OUT
rm -rf $out /tmp/results /tmp/sc_* /tmp/runs /tmp/tc_*; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
Q3VL_REQUIRE_GPU=1 timeout 170 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:Golden.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED|FAIL$" $out/unit.log | head -20 >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run fp8_pdl 8bfp8 1 70
run fp8_nopdl 8bfp8 1 70 Q3VL_PDL=0
run 8b_pdl 8b "1 64" 70
run 8b_gemv 8b 1 60 Q3VL_DENSE_GEMV=1
run 30b_gemv 30b "1 64" 140 Q3VL_DENSE_GEMV=1
rem=$((590 - SECONDS + T0)); ((rem > 100)) && run 30b_nopdl 30b 1 $((rem - 5)) Q3VL_PDL=0
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
