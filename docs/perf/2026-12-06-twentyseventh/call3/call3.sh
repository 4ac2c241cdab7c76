#!/usr/bin/env bash
# call 3 (twenty-seventh session): (1) the op table's linear and argmax cases, DevInfer.* and Golden.* with the new
# GEMV defaults (bf16 on cuBLASLt; the TMA GEMV for 8-bit products of 2-8 rows or 64 MiB), and the 8-bit linear cases
# again with Q3VL_GEMV_TMA=1 (every one-row product through the TMA GEMV); (2) one stream of the 8B bf16 and fp8 on
# the new defaults, the bf16 also with Q3VL_GEMV_TMA=1; (3) the 2B shape with the overlapped update and without.
# Each step only while the call has room.
source tools/gpu/call_lib.sh call3
Q3VL_OPS=linear,argmax unit_gpu 'BackendOps.*:DevInfer.*:Golden.*' 150
mv "$out/unit.log" "$out/unit_default.log"
left 60 && { Q3VL_GEMV_TMA=1 Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*' 60; mv "$out/unit.log" "$out/unit_tma1.log"; }
left 60 && serve_one bf16 8b 60
left 60 && serve_one fp8 8bfp8 60
left 60 && serve_one bf16_tma1 8b 60 Q3VL_GEMV_TMA=1
left 130 && train_prof q2b input/bench_2b_gpu.deck 130 run.profile_top=0
left 130 && Q3VL_OVERLAP_UPDATE=0 train_prof q2b_off input/bench_2b_gpu.deck 130 run.profile_top=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
