#!/usr/bin/env bash
# call 4 (thirty-second session; never ran: no device time left), on an H200 (needs_h200: issue 30's 30B-A3B cut
# needs its memory), binaries of 9d3d42e or later. (1) one 8B stream, fp8 and bf16, the default against
# Q3VL_CHAIN_ATTN=1 (the attention in the chain, chained layers): issue 32's goals are the H200's; (2) the 30B-A3B
# served at one stream, the default against Q3VL_CHAIN_ATTN=1 (each MoE layer's attention one kernel); (3) issue
# 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call4
serve_one fp8 8bfp8 55
serve_one fp8_attn 8bfp8 55 Q3VL_CHAIN_ATTN=1
serve_one bf16 8b 70
serve_one bf16_attn 8b 70 Q3VL_CHAIN_ATTN=1
left 130 && serve_one q30b 30b 110
left 130 && serve_one q30b_attn 30b 110 Q3VL_CHAIN_ATTN=1
left 250 && vs_hf 30b && prof_rows q30b
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
