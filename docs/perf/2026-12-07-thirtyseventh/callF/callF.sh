#!/usr/bin/env bash
# call F (thirty-seventh session, any GPU; call E's pack): the GPU suites of the training side, which the thirty-sixth
# session's mlp_fwd change (its plain MoE case runs the decode chain's MoE ops, dev::chain_moe_ops) touches and which
# were GPU-checked only through Golden.Cuda* since: the device model, layer and vision suites and the profiler's, then
# the op table's MoE and grouped cases in bf16 (the thirty-sixth session's call D without its 30B-A3B runs).
source tools/gpu/call_lib.sh callF
unit_gpu 'DevModel.*:DevLayers.*:DevVision.*:Profile.*' 150
cp "$out/unit.log" "$out/unit_train.log"
Q3VL_OPS=moe,grouped unit_gpu 'BackendOps.Bf16' 120
cp "$out/unit.log" "$out/unit_ops.log"
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
