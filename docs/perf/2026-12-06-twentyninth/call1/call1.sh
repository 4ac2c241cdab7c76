#!/usr/bin/env bash
# call 1 (twenty-ninth session, binaries of the session's head): (1) the op table's 8-bit linear cases (the decode
# folds: x read through its RMSNorm, the product added to y) and DevInfer.* (the golden models served with 8-bit
# weights: decode steps fold), then the op table's cases through the TMA-fed GEMV at one row; (2) one stream of the
# 8B fp8 with the folds (the default) and with Q3VL_DECODE_FOLD=0; (3) on an H200, issue 30's 30B-A3B cut (6 layers,
# 1 x 4096 tokens) with the overlapped update beside transformers; (4) one stream of the 30B-A3B fp8, folds on and off.
# Each step only while the call has room.
source tools/gpu/call_lib.sh call1
Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*:DevInfer.*' 150
cp "$out/unit.log" "$out/unit_default.log"
Q3VL_OPS=linear_q8 Q3VL_GEMV_TMA=1 unit_gpu 'BackendOps.*' 60
left 70 && serve_one fp8 8bfp8 65
left 70 && serve_one fp8_nofold 8bfp8 65 Q3VL_DECODE_FOLD=0
if nvidia-smi -L | grep -q H200 && left 210; then
  train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
  hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens, overlapped update"
  prof_rows q30b
fi
left 75 && serve_one fp8_30b 30bfp8 70
left 75 && serve_one fp8_30b_nofold 30bfp8 70 Q3VL_DECODE_FOLD=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
