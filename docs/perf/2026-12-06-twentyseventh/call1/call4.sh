#!/usr/bin/env bash
# call 4 (twenty-sixth session): the TMA-fed GEMV as the default for one-matrix decode products (8 consumer warps,
# the first stages prefetched into L2 before the wait instead of loaded), experts on the ring.
# (1) the op table's linear and argmax cases (argmax_rows now reads float4s, 4 in flight a thread), DevInfer.* and
# Golden.* on the defaults; (2) one stream each of the 8B fp8, the 8B bf16 and the 30B-A3B bf16, on the default and
# with Q3VL_GEMV_TMA=0 (the ring and cuBLASLt) back to back;
# (3) gemv_bench (its last table: argmax_rows at 1, 8 and 64 rows). Each step only while the call has room.
source tools/gpu/call_lib.sh call4
Q3VL_OPS=linear,argmax unit_gpu 'BackendOps.*:DevInfer.*:Golden.*' 150
left 80 && serve_one fp8_tma 8bfp8 80
left 80 && serve_one fp8_off 8bfp8 80 Q3VL_GEMV_TMA=0
left 80 && serve_one bf16_tma 8b 80
left 80 && serve_one bf16_off 8b 80 Q3VL_GEMV_TMA=0
left 40 && { timeout 60 /tmp/rt/bin/gemv_bench 40 > "$out/gemv_bench.txt" 2> "$out/gemv_bench.err"; say "gemv_bench rc=$?"; pack; }
left 100 && serve_one 30b_tma 30b 100
left 100 && serve_one 30b_off 30b 100 Q3VL_GEMV_TMA=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
