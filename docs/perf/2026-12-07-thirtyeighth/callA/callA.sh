#!/usr/bin/env bash
# call A (thirty-eighth session; the thirty-sixth session's call C; needs_h200: the 6-layer 30B-A3B cut's fp32
# training state does not fit an H100's 80 GB): issue 30's 30B-A3B cut beside transformers (the optimizer update
# overlapped with the next forward, the default since the twenty-eighth session, never measured at 6 layers), then
# on the same H200 issue 32's one-stream figures: chain_bench's A/B of the chain kernel's flags, then the 8B fp8, the
# 8B bf16, the 30B-A3B bf16 (the defaults of 60bb9e4's pack: the thirty-sixth session's).
source tools/gpu/call_lib.sh callA
vs_hf 30b && prof_rows q30b
chain_ab 6,14,15,16,17,9,18 60
left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
left 60 && serve_own q8b 8B ""
left 130 && serve_own q30b_moe 30B-A3B ""
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
