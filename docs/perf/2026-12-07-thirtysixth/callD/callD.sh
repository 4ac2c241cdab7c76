#!/usr/bin/env bash
# call D (thirty-sixth session, an H100: the H200 of call C was refused four times): the training side of this
# session's change (mlp_fwd's plain MoE case now runs the decode chain's MoE ops, dev::chain_moe_ops) on the GPU: the
# training suites and the op table's MoE and grouped cases in bf16; then the 30B-A3B cut at 3 layers (the 6 do not fit
# an H100) beside transformers, as the twenty-eighth session's call 2h (3.48x then).
source tools/gpu/call_lib.sh callD
unit_gpu 'DevModel.*:DevLayers.*:DevVision.*:Profile.*' 120
cp "$out/unit.log" "$out/unit_train.log"
Q3VL_OPS=moe,grouped unit_gpu 'BackendOps.Bf16' 90
cp "$out/unit.log" "$out/unit_ops.log"
left 250 && train_prof q30b3 input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 model.text_layers=3
left 160 && hf_train hf30b3 150 --preset 30B-A3B --text-layers 3 --batch 1 --seq 4096
ratio q30b3 hf30b3 "30B-A3B x 3 layers, 1 x 4096 tokens"
prof_rows q30b3
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
