#!/usr/bin/env bash
# call 1 (thirty-second session; the thirty-first session's call 7, which never ran), on an H200 (needs_h200: issue 30's 30B-A3B cut needs its memory): binaries of 4a566c7,
# as call 6 (H100), whose op-table cases passed. (1) one stream of the 8B, fp8 and bf16, the chain (default) against
# Q3VL_DECODE_CHAIN=0, back to back (on the H200 cuBLASLt streamed the 8B's bf16 gate_up faster than the TMA GEMV:
# does the bf16 chain still win?); (2) issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call1
serve_one fp8 8bfp8 60
serve_one fp8_nochain 8bfp8 60 Q3VL_DECODE_CHAIN=0
serve_one bf16 8b 80
serve_one bf16_nochain 8b 80 Q3VL_DECODE_CHAIN=0
if nvidia-smi -L | grep -q H200 && left 250; then
  vs_hf 30b
  prof_rows q30b
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
