#!/usr/bin/env bash
# call 2 (eighteenth session): the backward in FA3's order (dQ, then dK; dQ's registers staged while dK runs; the
# staging buffer's wait after the dQ product): bin/attn_check against the fp64 reference and timed; call 1's kernels
# (attn_check_c1) timed beside it; ablations on top (call2/ablations.patch, timing only, the first 3 cases): 21 no wait
# for the staging buffer (unsafe), 22 no reduction sent; the GPU suites; the 2B against transformers.
source tools/gpu/call_lib.sh res2
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
for v in c1 21 22; do
  timeout 60 /tmp/rt/bin/attn_check_$v --no-checks --first 3 > $out/abl$v.txt 2>&1
  say "abl $v rc=$?: $(grep -A3 '^case (median' $out/abl$v.txt | tail -3 | awk '{printf "%s %s fwd %s bwd %s | ", $4, $6, $8, $12}')"
done
pack
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -14 $out/q2b_profile.txt
