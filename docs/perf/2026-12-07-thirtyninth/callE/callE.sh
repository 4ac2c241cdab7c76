#!/usr/bin/env bash
# call E (thirty-ninth session, either GPU kind; binaries of f664d3f: the update's SM share deleted). On an H200:
# issue 30's 30B-A3B cut at 6 layers beside transformers (never measured there since the update overlaps the next
# forward), then the update in the backward with its stream below the model's (Q3VL_UPDATE_PRIO=low), the op table's
# adamw/sum_squares/sum_slots cases and one 8B fp8 stream (issue 32). On an H100: the cut at 3 layers, the same
# update in the backward against the default, the op table's cases, train_checks.sh part inbwd (the MoE golden model
# now in bf16: the experts' squares taken in the epilogue, dev::sum_slots adding them).
source tools/gpu/call_lib.sh callE
left() { (( 215 - (SECONDS - T0) > $1 )); }  # ~600 s of device time left this session, the start included
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
ub="optim.clip=0 optim.update_in_backward=true"
if [[ $mem -gt 100000 ]]; then
  vs_hf 30b && prof_rows q30b
  left 100 && Q3VL_UPDATE_PRIO=low train_prof q30ublow input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 $ub &&
    ratio q30ublow hf30b "30B-A3B x 6 layers, the update in the backward, its stream below the model's" &&
    prof_rows q30ublow
  left 50 && Q3VL_OPS=adamw,sum_squares,sum_slots unit_gpu 'BackendOps.Fp32' 45
  left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
else
  Q3VL_UPDATE_PRIO=low train_prof q30ublow input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=3 $ub
  train_prof q30 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=3
  prof_rows q30ublow q30
  left 50 && Q3VL_OPS=adamw,sum_squares,sum_slots unit_gpu 'BackendOps.Fp32' 45
  if left 100; then
    t1=$SECONDS
    timeout 140 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc inbwd > /dev/null 2>&1
    mkdir -p "$out/tc"; tar xzf /tmp/tc/results.tgz -C "$out/tc" 2>/dev/null
    say "train_checks inbwd $((SECONDS - t1)) s:"; grep -E "PASS|FAIL|ubnan|ubmoe|rc=[1-9]" "$out/tc/summary.txt" >> "$out/summary.txt"; pack
  fi
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
