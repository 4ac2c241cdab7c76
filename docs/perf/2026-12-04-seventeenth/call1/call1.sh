#!/usr/bin/env bash
# call 1 (seventeenth session): the backward's dQ accumulator in tiles (one bulk reduction per warpgroup and query
# tile instead of one per row): bin/attn_check against the fp64 reference and timed; the GPU suites; the 2B
# (issue 30's shape) profiled.
source tools/gpu/call_lib.sh res1
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -24 $out/q2b_profile.txt
