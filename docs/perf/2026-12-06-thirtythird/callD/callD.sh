#!/usr/bin/env bash
# call D (for the next session; needs_h200: issue 30's 30B-A3B cut), binaries of 6423ff2 or later (the attention link
# on by default). About 560 s. (1) the 30B-A3B at one stream, the default (each MoE layer's attention one chain
# kernel) against Q3VL_CHAIN_ATTN=0; (2) the 8B bf16 at 64 streams (issue 32's 5,000 tok/s: at more than 8 rows the
# chain's links run one by one, so this checks that nothing moved); (3) issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh callD
serve_one q30b 30b 110
serve_one q30b_noattn 30b 110 Q3VL_CHAIN_ATTN=0
left 250 && serve_one bf16_c64 8b 120 CONC=64
left 250 && vs_hf 30b && prof_rows q30b
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
