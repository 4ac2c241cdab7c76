#!/usr/bin/env bash
# call A (thirty-ninth session; needs_h200: the 6-layer 30B-A3B cut's fp32 training state does not fit an H100's
# 80 GB): issue 30's 30B-A3B cut beside transformers (the default: the update overlapped with the next forward), then
# issue 32's one-stream figures (8B fp8, 8B bf16, 30B-A3B bf16), then the chain kernel's flags A/B, the update in the
# backward at 6 layers (its stream at the model's priority and below it) and the op table's adamw/sum_squares/sum_slots cases if time is left. The pack: 60bb9e4.
source tools/gpu/call_lib.sh callA
vs_hf 30b && prof_rows q30b
left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
left 60 && serve_own q8b 8B ""
left 130 && serve_own q30b_moe 30B-A3B ""
left 100 && train_prof q30ub input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 optim.clip=0 \
  optim.update_in_backward=true && ratio q30ub hf30b "30B-A3B x 6 layers, the update in the backward" && prof_rows q30ub
left 100 && Q3VL_UPDATE_PRIO=low train_prof q30ublow input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 optim.clip=0 \
  optim.update_in_backward=true && ratio q30ublow hf30b "30B-A3B x 6 layers, the update in the backward, its stream low" &&
  prof_rows q30ublow
left 50 && Q3VL_OPS=adamw,sum_squares,sum_slots unit_gpu 'BackendOps.Fp32' 45
left 70 && chain_ab 6,14,15,16,17,9,18 60
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
