#!/usr/bin/env bash
# call 3 (eighteenth session): the forward keeps its running max until some row of a warp grows by more than 2^8
# (most tiles then leave the output unscaled): bin/attn_check against the fp64 reference and timed, call 2's kernels
# (attn_check_c2) timed beside it; the GPU suites; the 2B against transformers.
source tools/gpu/call_lib.sh res3
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
timeout 60 /tmp/rt/bin/attn_check_c2 --no-checks --first 3 > $out/attn_c2.txt 2>&1
say "c2 rc=$?: $(grep -A3 '^case (median' $out/attn_c2.txt | tail -3 | awk '{printf "%s %s fwd %s bwd %s | ", $4, $6, $8, $12}')"
pack
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -16 $out/q2b_profile.txt
