#!/usr/bin/env bash
# call G (written in the thirty-fifth session for the next one; devpack/rt.tar.xz holds the pack of 837f3fd: the MoE
# link and the SwiGLU pair by default): issue 32's one-stream figures on an H200 with this head. DevInfer.* and
# Golden.*, the op table's linear_chain cases, then one stream each: 30B-A3B bf16 with the MoE link and without
# (Q3VL_CHAIN_MOE=0), 8B fp8, 8B bf16 (serve_own: the servers' logs come back whatever happens).
source tools/gpu/call_lib.sh callG
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 150
cp "$out/unit.log" "$out/unit_ops.log"
left 130 && serve_own q30b_moe 30B-A3B ""
left 130 && serve_own q30b 30B-A3B "" Q3VL_CHAIN_MOE=0
left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
left 60 && serve_own q8b 8B ""
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
