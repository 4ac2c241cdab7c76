#!/usr/bin/env bash
# call 2 (fifteenth session): the GPU suites again (call 1's run stopped at a test that freed its exec before its
# model); input/bench_2b_gpu.deck at issue 30's shape (one micro-step of 4 x 4096 tokens, an image each, the
# baseline's), profiled with every row, against transformers in the same call; the 30B-A3B cut's profile (the
# gradient norm over merged runs).
source tools/gpu/call_lib.sh res2
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 80 run.profile_top=0 train.steps=6
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; head -60 $out/q2b_profile.txt; grep -E "sum_squares|adamw|compute stream" $out/q30b_profile.txt
