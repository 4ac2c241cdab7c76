#!/usr/bin/env bash
# call 3 (seventeenth session): at hd 128 the backward's key blocks in clusters of 2, one block's dQ part added to
# the other's in shared memory before one reduction (half the reduced bytes): bin/attn_check against the fp64
# reference and timed; the GPU suites; the 2B (issue 30's shape) and the 30B-A3B cut, each against transformers in
# the same call.
source tools/gpu/call_lib.sh res3
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -14 $out/q2b_profile.txt
