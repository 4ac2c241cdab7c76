#!/usr/bin/env bash
# call 3 (thirty-second session): binaries of the chained layers (a decode step's consecutive dense layers as one chain
# kernel, attention links inside, up to 64 links: 12 layers of five), after call 2 (H100) passed the attention link's
# op-table cases and measured it alone (8B fp8 4.08 -> 4.03 ms).
# (1) the op table's linear_chain cases, DevInfer.* (the hd64 cases: both layers of the dense model as one kernel) and
#     Golden.*; (2) one stream of the 8B, fp8 and bf16: the default against Q3VL_CHAIN_LAYERS=1 (a chain a layer) and
#     Q3VL_CHAIN_ATTN=0 (the attention's two ops, a chain a layer: the thirty-first session's default), back to back;
#     (3) serve_checks' tiny part.
source tools/gpu/call_lib.sh call3
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 120
cp "$out/unit.log" "$out/unit_ops.log"
unit_gpu 'DevInfer.*:Golden.*' 120
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8 8bfp8 60
serve_one fp8_layer 8bfp8 60 Q3VL_CHAIN_LAYERS=1
serve_one fp8_noattn 8bfp8 60 Q3VL_CHAIN_ATTN=0
left 90 && serve_one bf16 8b 80
left 90 && serve_one bf16_noattn 8b 80 Q3VL_CHAIN_ATTN=0
left 40 && serve_one tiny tiny 40
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
