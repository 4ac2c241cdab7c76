#!/usr/bin/env bash
# call 2 (thirtieth session, binaries of 9f7900b): (1) the op table's 8-bit linear cases (with linear_q8_chain's: the
# persistent chain of gemv_chain.cuh against the CPU's links in turn) and MoE combine cases (store_y shared, put_max),
# and DevInfer.* by default and with Q3VL_DECODE_CHAIN=1 (the golden models' dense 8-bit layers through the chain);
# (2) one stream of the 8B fp8: default, Q3VL_DECODE_CHAIN=1, and that with Q3VL_GEMV_TMA=1; (3) the op table's 8-bit
# linear cases with Q3VL_GEMV_TMA=1 (the norm fold at one row through the TMA-fed GEMV), while the call has room.
source tools/gpu/call_lib.sh call2
Q3VL_OPS=linear_q8,moe_combine unit_gpu 'BackendOps.*:DevInfer.*' 170
cp "$out/unit.log" "$out/unit_default.log"
Q3VL_DECODE_CHAIN=1 unit_gpu 'DevInfer.*' 60
cp "$out/unit.log" "$out/unit_chain.log"
serve_one fp8 8bfp8 55
serve_one fp8_chain 8bfp8 55 Q3VL_DECODE_CHAIN=1
left 60 && serve_one fp8_chain_tma 8bfp8 55 Q3VL_DECODE_CHAIN=1 Q3VL_GEMV_TMA=1
left 150 && Q3VL_OPS=linear_q8 Q3VL_GEMV_TMA=1 unit_gpu 'BackendOps.*' 140
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
