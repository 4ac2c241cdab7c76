#!/usr/bin/env bash
# call 4 (twenty-ninth session, binaries of d65e752, one H200 only): issue 30's 30B-A3B cut (6 layers, 1 x 4096
# tokens) with the overlapped update beside transformers; then one stream of the 8B fp8 with the decode folds and
# without (Q3VL_DECODE_FOLD=0), while the call has room.
source tools/gpu/call_lib.sh call4
if nvidia-smi -L | grep -q H200; then
  vs_hf 30b
  prof_rows q30b
  left 60 && serve_one fp8 8bfp8 55
  left 60 && serve_one fp8_nofold 8bfp8 55 Q3VL_DECODE_FOLD=0
else
  say "not an H200: nothing run"
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
