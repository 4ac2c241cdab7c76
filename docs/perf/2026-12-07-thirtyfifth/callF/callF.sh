#!/usr/bin/env bash
# call F (thirty-fifth session, on call E's warm machine, the device time left): the op table's linear_chain cases in
# fp16 (call C's ran out of time there), DevInfer.* and Golden.*, and one 8B fp8 stream with the SwiGLU pair
# (Q3VL_CHAIN_SWIGLU=1; tile ends synchronous, as chain_bench preferred in call C) and without.
source tools/gpu/call_lib.sh callF
pkill -9 -f 'rt/bin/q3vl'
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.Fp16' 60
cp "$out/unit.log" "$out/unit_ops16.log"
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8_pair 8bfp8 50 Q3VL_CHAIN_SWIGLU=1; pkill -9 -f 'rt/bin/q3vl'
serve_one fp8 8bfp8 50; pkill -9 -f 'rt/bin/q3vl'
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
