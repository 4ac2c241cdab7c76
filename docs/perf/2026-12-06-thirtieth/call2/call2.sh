#!/usr/bin/env bash
# call 2 (thirtieth session, binaries of d02737e, the warm machine of call 1): the op table's 8-bit linear and MoE
# combine cases (store_y shared by the GEMVs and k_combine_fwd, tc_stage's put_max) and DevInfer.* by default; the
# op table's 8-bit linear cases with Q3VL_GEMV_TMA=1 (the norm fold at one row through the TMA-fed GEMV); then one
# stream of the 30B-A3B fp8 by default and with Q3VL_GEMV_TMA=1, while the call has room.
source tools/gpu/call_lib.sh call2
Q3VL_OPS=linear_q8,moe_combine unit_gpu 'BackendOps.*:DevInfer.*' 170
cp "$out/unit.log" "$out/unit_default.log"
Q3VL_OPS=linear_q8 Q3VL_GEMV_TMA=1 unit_gpu 'BackendOps.*' 150
left 140 && serve_one fp8_30b 30bfp8 130
left 140 && serve_one fp8_30b_tma 30bfp8 130 Q3VL_GEMV_TMA=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
