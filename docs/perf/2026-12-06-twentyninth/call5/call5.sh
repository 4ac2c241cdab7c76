#!/usr/bin/env bash
# call 5 (twenty-ninth session, binaries of d65e752, the H100 of chain_bench's runs, warm): one stream of the 8B fp8
# by default and with Q3VL_GEMV_TMA=1 (every one-row GEMV through the TMA-fed kernel), which chain_bench found 7%
# faster on this H100's chain of the four linears (96.4 against 103.9 us a layer).
source tools/gpu/call_lib.sh call5
serve_one fp8 8bfp8 55
left 60 && serve_one fp8_tma 8bfp8 55 Q3VL_GEMV_TMA=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
