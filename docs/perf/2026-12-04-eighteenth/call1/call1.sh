#!/usr/bin/env bash
# call 1 (eighteenth session): the forward's softmax with one FFMA a score (bin/attn_check against the fp64
# reference, timed); the backward timed after GEMMs (--hot: four 16384x2048->12288 GEMMs before every timed call,
# as in a training step); the backward's ablations (attn_check_N, -DQ3_ABL=N, call1/ablations.patch; timing only,
# the first 3 cases): 11 no exp or mask, 12 no dQ GEMM and no reduction, 13 no dK GEMM, 14 no S^T GEMM, 15 no block
# barrier at the loop's top, 16 no dV GEMM, 17 no dS stores, 18 neither dK nor dV, 19 the dQ GEMM but no reduction;
# the 2B profiled.
source tools/gpu/call_lib.sh res1
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
timeout 90 /tmp/rt/bin/attn_check --no-checks --first 3 --hot > $out/attn_hot.txt 2>&1
say "hot rc=$?: $(grep -A3 '^case (median' $out/attn_hot.txt | tail -3 | awk '{printf "%s %s fwd %s bwd %s | ", $4, $6, $8, $12}')"
timeout 60 /tmp/rt/bin/attn_check --no-checks --first 3 > $out/abl0.txt 2>&1
say "abl 0 rc=$?: $(grep -A3 '^case (median' $out/abl0.txt | tail -3 | awk '{printf "%s %s bwd %s | ", $4, $6, $12}')"
pack
for v in 11 12 13 14 15 16 17 18 19; do
  timeout 60 /tmp/rt/bin/attn_check_$v --no-checks --first 3 > $out/abl$v.txt 2>&1
  say "abl $v rc=$?: $(grep -A3 '^case (median' $out/abl$v.txt | tail -3 | awk '{printf "%s %s bwd %s | ", $4, $6, $12}')"
done
pack
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -14 $out/q2b_profile.txt
