#!/usr/bin/env bash
# call 1 (thirteenth session): the wgmma attention at head dims 64 and 72 (bin/attn_check against the fp64 reference
# and timed; the op table's attention cases, CUDA against the CPU); where the training steps' time goes now, by shape
# (run.profile_shapes): the 2B shape (input/bench_2b_gpu.deck, step 3 of 4) and the 30B-A3B cut
# (input/bench_30b_a3b_gpu.deck, step 3 of 4).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res1 final=$OUT
rm -rf $out /tmp/runs; mkdir -p $out
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
prof() {  # NAME DECK TIMEOUT
  local t1=$SECONDS
  timeout $3 $q train $2 train.steps=4 checkpoint.every=0 run.profile=true run.profile_step=3 run.profile_shapes=true \
    run.out_dir=/tmp/runs/$1 > $out/$1.log 2>&1
  say "$1 rc=$? $((SECONDS-t1)) s"; rm -rf /tmp/runs/$1
  sed -n '/^profile of step 3/,/compute stream busy/p' $out/$1.log > $out/$1_profile.txt; pack
}
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn_check.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep -c PASS $out/attn_check.txt >> $out/summary.txt; grep FAIL $out/attn_check.txt | head >> $out/summary.txt; pack
t1=$SECONDS; Q3VL_REQUIRE_GPU=1 timeout 120 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-t1)) s"; tail -3 $out/unit.log >> $out/summary.txt; pack
prof 2b input/bench_2b_gpu.deck 200
prof 30b input/bench_30b_a3b_gpu.deck 240
say "done $((SECONDS-T0)) s"; pack
cat $out/summary.txt; sed -n '/^old: mma/,$p' $out/attn_check.txt; head -45 $out/2b_profile.txt; head -40 $out/30b_profile.txt
