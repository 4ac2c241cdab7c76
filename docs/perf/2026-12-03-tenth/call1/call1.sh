#!/usr/bin/env bash
# call 1 (2026-12-03, tenth session), q3vl at m10 (every warp stages the GEMV's x; experts at n <= 8 on TcWide again):
# the GPU suites, gemv_bench, the 30B-A3B at 1 and 64 streams, the 8B fp8 and bf16 at 1 stream (profiled one row a
# step), then the 30B-A3B training cut (6 layers) profiled op by op at step 3 (killed in its final checkpoint).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res1 final=$OUT
rm -rf $out /tmp/results /tmp/sc_* /tmp/runs; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
Q3VL_REQUIRE_GPU=1 timeout 170 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:Golden.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED|FAIL$" $out/unit.log | head >> $out/summary.txt; pack
timeout 100 /tmp/rt/bin/gemv_bench > $out/gemv_bench.txt 2>&1; say "gemv_bench rc=$? $((SECONDS-T0)) s"
grep -E "FAIL" $out/gemv_bench.txt | head -5 >> $out/summary.txt; tail -2 $out/gemv_bench.txt >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 30b 30b "1 64" 150 PROFILE=2 PROFILE_ROWS=1
rem=$((420 - SECONDS + T0)); ((rem > 50)) && run 8bfp8 8bfp8 1 $rem PROFILE=2 PROFILE_ROWS=1
rem=$((490 - SECONDS + T0)); ((rem > 50)) && run 8b 8b 1 $rem PROFILE=2 PROFILE_ROWS=1
rem=$((570 - SECONDS + T0))
if ((rem > 40)); then
  timeout $rem $q train input/bench_30b_a3b_gpu.deck train.steps=4 checkpoint.every=0 run.profile=true \
    run.profile_step=3 run.out_dir=/tmp/runs/moeprof > $out/moe_profile.log 2>&1
  say "moe profile rc=$? $((SECONDS-T0)) s"; cp /tmp/runs/moeprof/metrics.jsonl $out/moe_profile.jsonl 2>/dev/null
  rm -rf /tmp/runs; pack
fi
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
