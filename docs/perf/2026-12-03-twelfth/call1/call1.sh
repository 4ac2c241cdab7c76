#!/usr/bin/env bash
# call 1 (2026-12-03, twelfth session): the decode GEMV fed by a bulk-copy ring (k_gemv_bulk): gemv_bench (every
# path checked against cuBLASLt), the GPU suites with the ring on, one stream served with the ring on and off.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res1 final=$OUT
rm -rf $out /tmp/results /tmp/sc_* /tmp/runs /tmp/tc_*; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 200 /tmp/rt/bin/gemv_bench 60 > $out/gemv_bench.txt 2> $out/gemv_bench.err
say "gemv_bench rc=$? $((SECONDS-T0)) s: $(grep -c FAIL $out/gemv_bench.txt) FAIL rows; $(tail -1 $out/gemv_bench.err)"; pack
Q3VL_REQUIRE_GPU=1 timeout 150 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:Golden.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED|FAIL$" $out/unit.log | head -20 >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  rm -rf /tmp/results
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run fp8 8bfp8 1 70
run fp8regs 8bfp8 1 70 Q3VL_GEMV_RING=0
rem=$((560 - SECONDS + T0)); ((rem > 110)) && run 30b 30b 1 $((rem - 5)) PROFILE=2 PROFILE_ROWS=1
rem=$((580 - SECONDS + T0)); ((rem > 60)) && run 8b 8b 1 $((rem - 5))
say "done $((SECONDS-T0)) s"; pack
grep -E "unit|gemv_bench|c=1 |c=64 |decode-only|done" $out/summary.txt | cut -c1-200
