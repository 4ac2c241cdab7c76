#!/usr/bin/env bash
# call 2 (twenty-ninth session, binaries of the session's head: the dense and MoE decode folds; devpack/tok.tar.xz
# carries the tokenizer the serving runs need, which call 1 lacked): (1) the op table's 8-bit linear and MoE combine
# cases and DevInfer.*; (2) one stream of the 8B fp8 with the folds (the default) and with Q3VL_DECODE_FOLD=0; (3) on
# an H200, issue 30's 30B-A3B cut (6 layers, 1 x 4096 tokens) with the overlapped update beside transformers; (4) one
# stream of the 30B-A3B fp8, folds on and off. Each step only while the call has room.
source tools/gpu/call_lib.sh call2
Q3VL_OPS=linear_q8,moe_combine unit_gpu 'BackendOps.*:DevInfer.*' 170
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
