#!/usr/bin/env bash
# call 3 (thirteenth session): the head with the norms in row groups (one-pass backward, deterministic column sums)
# and the query-head split only for groups of 4 or more: the GPU suites, the 2B and the 30B-A3B cut profiled by
# shape (step 3) and each against transformers in the same call.
source tools/gpu/call_lib.sh res3
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 170
train_prof q2b input/bench_2b_gpu.deck 150
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 85
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -B2 -A12 "Failure" $out/unit.log | head -60; head -40 $out/q2b_profile.txt; head -30 $out/q30b_profile.txt
