#!/usr/bin/env bash
# call 2h (twenty-eighth session, for an H100, where the 30B-A3B cut's 6 layers of fp32 AdamW state do not fit): the
# cut at 3 decoder layers with the overlapped optimizer update (now the default) and transformers at the same 3
# layers beside it, then Q3VL_OVERLAP_UPDATE=0; then one stream of the 8B fp8 with one decode-only step profiled op by
# op (PROFILE_ROWS=1), while the call has room.
source tools/gpu/call_lib.sh call2h
Q3VL_OVERLAP_UPDATE=1 train_prof q30b3 input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 model.text_layers=3
left 150 && hf_train hf30b3 150 --preset 30B-A3B --text-layers 3 --batch 1 --seq 4096
left 90 && Q3VL_OVERLAP_UPDATE=0 train_prof q30b3_off input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 model.text_layers=3
[[ -f $out/hf30b3.jsonl ]] && { ratio q30b3 hf30b3 "30B-A3B x 3, overlapped update"; ratio q30b3_off hf30b3 "30B-A3B x 3, Q3VL_OVERLAP_UPDATE=0"; }
prof_rows q30b3 q30b3_off
left 70 && serve_one prof8fp8 8bfp8 65 PROFILE=2 PROFILE_ROWS=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
