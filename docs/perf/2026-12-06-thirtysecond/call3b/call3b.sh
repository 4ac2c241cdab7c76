#!/usr/bin/env bash
# call 3b (thirty-second session): call 3 trimmed to what ~330 s of device time hold (call 3's machine was taken
# back before it returned anything): DevInfer.* (the hd64 cases: both layers of the dense model as one chain kernel)
# and Golden.*; one 8B fp8 stream, the default (chained layers) against Q3VL_CHAIN_LAYERS=1 and Q3VL_CHAIN_ATTN=0;
# then the op table's linear_chain cases.
source tools/gpu/call_lib.sh call3b
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8 8bfp8 55
serve_one fp8_layer 8bfp8 55 Q3VL_CHAIN_LAYERS=1
serve_one fp8_noattn 8bfp8 55 Q3VL_CHAIN_ATTN=0
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 90
cp "$out/unit.log" "$out/unit_ops.log"
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
