#!/usr/bin/env bash
# call 3 (fifteenth session): the GPU suites on the head (the fused qk_norm_rope_bwd in the op table and the model);
# the 2B (issue 30's shape) and the 30B-A3B cut profiled with every row and the new idle column, each against
# transformers in the same call.
source tools/gpu/call_lib.sh res3
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 85 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; head -40 $out/q2b_profile.txt; echo "idle before, by row:"; grep -E '^  [a-z]' $out/q2b_profile.txt | awk '{print $NF, $0}' | sort -rn | head -15
