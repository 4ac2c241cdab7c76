#!/usr/bin/env bash
# call 3 (twenty-ninth session, binaries of d65e752: q3vl and unit_tests only): (1) the op table's 8-bit linear and
# MoE combine cases and DevInfer.* on the final head (swiglu8 and norm8 share map8); (2) on an H200, issue 30's
# 30B-A3B cut (6 layers, 1 x 4096 tokens) with the overlapped update beside transformers, then one stream of the 8B
# fp8 with the decode folds and without (Q3VL_DECODE_FOLD=0). Each step only while the call has room.
source tools/gpu/call_lib.sh call3
Q3VL_OPS=linear_q8,moe_combine,swiglu unit_gpu 'BackendOps.*:DevInfer.*' 170
if nvidia-smi -L | grep -q H200; then
  if left 210; then
    train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
    hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
    ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens, overlapped update"
    prof_rows q30b
  fi
  left 60 && serve_one fp8 8bfp8 55
  left 60 && serve_one fp8_nofold 8bfp8 55 Q3VL_DECODE_FOLD=0
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
