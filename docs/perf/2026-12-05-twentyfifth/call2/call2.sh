#!/usr/bin/env bash
# call 2 (twenty-fifth session): the TMA-fed decode GEMV (src/tensor/cuda/gemv_tma.cuh) in serving, one stream, each
# pair back to back: the 8B bf16 with Q3VL_GEMV_TMA_DENSE=1 (its linears through the TMA GEMV) and on cuBLASLt (the
# default); the 30B-A3B bf16 with its experts through the TMA GEMV (Q3VL_GEMV_TMA=1) and through the ring (the
# default), then with the dense linears through it too. Each step only while the call has room.
source tools/gpu/call_lib.sh call2
left 80 && serve_one bf16_tma 8b 80 Q3VL_GEMV_TMA_DENSE=1
left 80 && serve_one bf16_cublas 8b 80
left 130 && serve_one 30b_tma 30b 130 Q3VL_GEMV_TMA=1
left 130 && serve_one 30b_ring 30b 130
left 130 && serve_one 30b_tma_dense 30b 130 Q3VL_GEMV_TMA=1 Q3VL_GEMV_TMA_DENSE=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
