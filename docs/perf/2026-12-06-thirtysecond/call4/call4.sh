#!/usr/bin/env bash
# call 4 (thirty-second session), on an H200 (needs_h200: issue 30's 30B-A3B cut needs its memory): the binaries of
# call 3. (1) the 30B-A3B served at one stream, the default (each layer's attention one kernel: a chain of its own)
# against Q3VL_CHAIN_ATTN=0; (2) issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call4
serve_one q30b 30b 110
left 150 && serve_one q30b_noattn 30b 110 Q3VL_CHAIN_ATTN=0
left 250 && vs_hf 30b && prof_rows q30b
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
