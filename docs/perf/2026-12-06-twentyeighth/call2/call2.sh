#!/usr/bin/env bash
# call 2 (twenty-eighth session, one H200: the 30B-A3B cut's 6 layers need its memory): the cut
# (input/bench_30b_a3b_gpu.deck, 1 x 4096 tokens a step) with the optimizer update overlapped with the next forward
# (Q3VL_OVERLAP_UPDATE=1), transformers beside it, then Q3VL_OVERLAP_UPDATE=0; then one stream of the 8B fp8 with
# one decode-only step profiled op by op (PROFILE_ROWS=1), while the call has room. (Call 1 ran train_checks.sh part
# overlap on an H100: every loss equal at bound 0.)
source tools/gpu/call_lib.sh call2
Q3VL_OVERLAP_UPDATE=1 train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
left 150 && hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
left 100 && Q3VL_OVERLAP_UPDATE=0 train_prof q30b_off input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
[[ -f $out/hf30b.jsonl ]] && { ratio q30b hf30b "30B-A3B x 6, overlapped update"; ratio q30b_off hf30b "30B-A3B x 6, Q3VL_OVERLAP_UPDATE=0"; }
prof_rows q30b q30b_off
left 70 && serve_one prof8fp8 8bfp8 65 PROFILE=2 PROFILE_ROWS=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
