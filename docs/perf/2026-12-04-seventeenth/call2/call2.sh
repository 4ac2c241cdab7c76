#!/usr/bin/env bash
# call 2 (seventeenth session): the backward's Q and dO tiles by TMA (hd 64 and 128) on top of call 1's dQ tiles:
# bin/attn_check against the fp64 reference and timed; then the ablations of the dQ reduction (attn_check_N, built
# with -DQ3_ABL=N by build_ablations.sh; timing only, the first 3 cases): 1 half the bytes, 2 a bulk store instead of
# the add, 3 adds into a private region per block, 4 nothing sent, 5 an evict-last hint, 6 key blocks fastest in the
# launch order, 7 cp.async instead of TMA (call 1's kernel); the GPU suites; the 2B profiled.
source tools/gpu/call_lib.sh res2
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
for v in 1 2 3 4 5 6 7; do
  timeout 60 /tmp/rt/bin/attn_check_$v --no-checks --first 3 > $out/abl$v.txt 2>&1
  say "abl $v rc=$?: $(grep -A3 '^case (median' $out/abl$v.txt | tail -3 | awk '{printf "%s %s bwd %s | ", $4, $6, $12}')"
done
pack
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -14 $out/q2b_profile.txt
