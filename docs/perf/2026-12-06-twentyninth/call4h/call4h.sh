#!/usr/bin/env bash
# call 4h (twenty-ninth session, binaries of d65e752, one H100 after the H200 was refused again): one stream of the
# 30B-A3B fp8 with the decode folds (a MoE layer: o_proj and the combine add to x, qkv reads x through its norm) and
# without (Q3VL_DECODE_FOLD=0); call 2's 70 s did not cover the load.
source tools/gpu/call_lib.sh call4h
serve_one fp8_30b 30bfp8 130
left 130 && serve_one fp8_30b_nofold 30bfp8 130 Q3VL_DECODE_FOLD=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
