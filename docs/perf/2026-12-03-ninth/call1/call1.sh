#!/usr/bin/env bash
# call 1 (2026-12-03, ninth session), q3vl at 714a8c6 (main 254a69c + paged2: the device-sized key splits of paged
# attention, + gemvtc: the tensor-core decode GEMV; neither run on a GPU before): paged_check (checks and A/B timing),
# the GPU op table and DevInfer suites, gemv_bench (old GEMV, tensor-core knobs, cuBLASLt), then the 8B shape
# at 1 stream profiled one row per step (bf16 and fp8), the 8B at 64 streams profiled (56+ rows), the 30B-A3B at 64 streams profiled (56+ rows) and
# at 1 stream profiled one row per step.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res1 final=$OUT; mkdir -p $out
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 90 /tmp/rt/bin/paged_check > $out/paged_check.txt 2>&1; say "paged_check rc=$? $((SECONDS-T0)) s"
grep -iE "fail|err [1-9]|mismatch" $out/paged_check.txt | head -5 >> $out/summary.txt; pack
Q3VL_REQUIRE_GPU=1 timeout 150 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED" $out/unit.log | head >> $out/summary.txt; pack
timeout 120 /tmp/rt/bin/gemv_bench > $out/gemv_bench.txt 2>&1; say "gemv_bench rc=$? $((SECONDS-T0)) s"
grep -E "FAIL" $out/gemv_bench.txt | head -5 >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 8b1 8b 1 80 PROFILE=2 PROFILE_ROWS=1
run 8bfp8 8bfp8 1 80 PROFILE=2 PROFILE_ROWS=1
run 8b64 8b 64 110 PROFILE=2
run 30b64 30b 64 170 PROFILE=2
rem=$((560 - SECONDS + T0)); ((rem > 100)) && run 30b1 30b 1 $rem PROFILE=2 PROFILE_ROWS=1
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
