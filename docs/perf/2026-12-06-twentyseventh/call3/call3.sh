#!/usr/bin/env bash
# call 3 (twenty-seventh session): the 30B-A3B cut (input/bench_30b_a3b_gpu.deck: 1 x 4096 tokens a step) with the
# optimizer update overlapped with the next forward (the default) and with Q3VL_OVERLAP_UPDATE=0, transformers beside
# them; then the 2B shape both ways, while the call has room.
source tools/gpu/call_lib.sh call3
train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
Q3VL_OVERLAP_UPDATE=0 train_prof q30b_off input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
left 150 && hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
[[ -f $out/hf30b.jsonl ]] && { ratio q30b hf30b "30B-A3B x 6, overlapped update"; ratio q30b_off hf30b "30B-A3B x 6, Q3VL_OVERLAP_UPDATE=0"; }
prof_rows q30b q30b_off
left 130 && train_prof q2b input/bench_2b_gpu.deck 130 run.profile_top=0
left 130 && Q3VL_OVERLAP_UPDATE=0 train_prof q2b_off input/bench_2b_gpu.deck 130 run.profile_top=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
