#!/usr/bin/env bash
# call F (for the fortieth session, either GPU kind; binaries with update_hold.diff applied): where the update in the
# backward runs. The 30B-A3B cut (3 layers on an H100, 6 on an H200) beside transformers: the default (the update
# after the norm, overlapped with the next forward), the update in the backward beside the whole backward, below the
# model's priority (Q3VL_UPDATE_PRIO=low), held until the backward has passed the experts (Q3VL_UPDATE_HOLD=experts),
# and both; then train_checks.sh part inbwd and the op table's adamw/sum_squares/sum_slots cases if time is left.
source tools/gpu/call_lib.sh callF
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=3; [[ $mem -gt 100000 ]] && L=6
say "GPU memory $mem MiB: the 30B-A3B cut at $L layers"
ub="optim.clip=0 optim.update_in_backward=true"
d=input/bench_30b_a3b_gpu.deck
train_prof q30 $d 100 run.profile_top=0 model.text_layers=$L
hf_train hf30 150 --preset 30B-A3B --text-layers $L --batch 1 --seq 4096
ratio q30 hf30 "30B-A3B x $L layers, the default"
Q3VL_UPDATE_HOLD=experts train_prof q30hold $d 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30hold hf30 "30B-A3B x $L layers, the update in the backward held past the experts"
Q3VL_UPDATE_PRIO=low train_prof q30low $d 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30low hf30 "30B-A3B x $L layers, the update in the backward below the model's priority"
left 100 && Q3VL_UPDATE_HOLD=experts Q3VL_UPDATE_PRIO=low train_prof q30holdlow $d 100 run.profile_top=0 \
  model.text_layers=$L $ub && ratio q30holdlow hf30 "30B-A3B x $L layers, held past the experts and low"
prof_rows q30 q30hold q30low q30holdlow
say "$(grep -h 'units held until' "$out/q30hold.log" | head -1)"
if left 100; then
  t1=$SECONDS
  timeout 140 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc inbwd > /dev/null 2>&1
  mkdir -p "$out/tc"; tar xzf /tmp/tc/results.tgz -C "$out/tc" 2>/dev/null
  say "train_checks inbwd $((SECONDS - t1)) s:"; grep -E "PASS|FAIL|ubnan|ubmoe|ubhold|rc=[1-9]" "$out/tc/summary.txt" >> "$out/summary.txt"; pack
fi
left 50 && Q3VL_OPS=adamw,sum_squares,sum_slots unit_gpu 'BackendOps.Fp32' 45
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
