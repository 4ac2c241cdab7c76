#!/usr/bin/env bash
# call 4 (twenty-eighth session, one H200, the device time's last ~6 minutes): issue 30's 30B-A3B cut (6 layers,
# 1 x 4096 tokens) with the overlapped update, now the default, and transformers beside it.
source tools/gpu/call_lib.sh call4
train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens, overlapped update"
prof_rows q30b
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
