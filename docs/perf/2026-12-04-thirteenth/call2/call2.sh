#!/usr/bin/env bash
# call 2 (thirteenth session): the GPU suites and attn_check on the head (the wgmma backward at hd 64/72, the query
# heads split over blocks, vectorized norms and elementwise kernels); the 2B and the 30B-A3B cut profiled by shape
# (step 3) and each against transformers in the same call.
source tools/gpu/call_lib.sh res2
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 170
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn_check.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s, $(grep -c PASS $out/attn_check.txt) PASS lines"; grep FAIL $out/attn_check.txt | head >> $out/summary.txt; pack
train_prof q2b input/bench_2b_gpu.deck 150
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 85
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; sed -n '/^old: mma/,$p' $out/attn_check.txt; head -32 $out/q2b_profile.txt; head -22 $out/q30b_profile.txt
