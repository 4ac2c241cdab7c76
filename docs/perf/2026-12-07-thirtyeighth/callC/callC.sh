#!/usr/bin/env bash
# call C (thirty-eighth session, the last ~250 s of its device time): call B's first pair only, the 30B-A3B cut at 3
# layers (either GPU kind), the update in the backward on 24 SMs of its own against the default; profiles of step 3.
source tools/gpu/call_lib.sh callC
Q3VL_UPDATE_SMS=24 train_prof q30s24 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=3 \
  optim.clip=0 optim.update_in_backward=true
train_prof q30 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=3
prof_rows q30s24 q30
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
