#!/usr/bin/env bash
# call B (thirty-third session), on an H200, binaries of 9d3d42e: (1) the 30B-A3B at one stream, the default against
# Q3VL_CHAIN_ATTN=1 (each MoE layer's attention one kernel); (2) issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh callB
serve_one q30b 30b 110
serve_one q30b_attn 30b 110 Q3VL_CHAIN_ATTN=1
left 250 && vs_hf 30b && prof_rows q30b
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
