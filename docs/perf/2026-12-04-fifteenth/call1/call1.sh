#!/usr/bin/env bash
# call 1 (fifteenth session): the GPU suites on the head (write-first weight gradients; the vision tower's q, k, v as
# one batched GEMM; the norms' backward chunk rule); the 2B and the 30B-A3B cut profiled by shape with every op row
# (run.profile_top=0), each against transformers in the same call; the norms' chunk floor A/B on the 2B.
source tools/gpu/call_lib.sh res1
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 170
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 85 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
for r in 8 32; do
  Q3VL_NORM_CHUNK_ROWS=$r train_prof q2b_norm$r input/bench_2b_gpu.deck 90 train.steps=5
  say "norm chunk floor $r: $(grep -E '^  rmsnorm_bwd|^  layernorm_bwd' $out/q2b_norm${r}_profile.txt | tr -s ' ' | tr '\n' ';')"; pack
done
say "norm chunk floor 16: $(grep -E '^  rmsnorm_bwd|^  layernorm_bwd' $out/q2b_profile.txt | tr -s ' ' | tr '\n' ';')"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; head -100 $out/q2b_profile.txt; head -45 $out/q30b_profile.txt
