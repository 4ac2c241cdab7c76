#!/usr/bin/env bash
# call 3 (twenty-sixth session, run inline as one command line): the 30B-A3B with only its dense linears on the TMA
# GEMV (Q3VL_GEMV_TMA_DENSE=1, experts on the ring), the ring again, and the 8B bf16 on the TMA GEMV again (noise).
source tools/gpu/call_lib.sh call3; left 80 && serve_one 30b_dense 30b 80 Q3VL_GEMV_TMA_DENSE=1; left 80 && serve_one 30b_ring2 30b 80; left 40 && serve_one bf16_tma2 8b 40 Q3VL_GEMV_TMA_DENSE=1; say "done $((SECONDS - T0)) s"; pack; cat $out/summary.txt
