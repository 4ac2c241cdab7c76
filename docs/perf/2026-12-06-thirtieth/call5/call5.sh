#!/usr/bin/env bash
# call 5 (thirtieth session, unit_tests of the head after 9f7900b with the chain case's scratch made large enough:
# call 4's op table overran it on the host at 1001 columns): the op table's linear_q8_chain and moe_combine cases on
# the GPU (the persistent chain against the CPU's links in turn, bf16 and fp16 where the kernel runs), then the rest
# of the 8-bit linear cases while the device time lasts.
source tools/gpu/call_lib.sh call5
Q3VL_OPS=linear_q8_chain,moe_combine unit_gpu 'BackendOps.*' 100
cp "$out/unit.log" "$out/unit_chain_ops.log"
Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*' 130
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
