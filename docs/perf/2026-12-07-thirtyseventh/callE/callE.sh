#!/usr/bin/env bash
# call E (thirty-seventh session): issue 30's update in the backward (optim.update_in_backward, optim.clip = 0: each
# unit's AdamW on the update's stream as the backward completes the unit's gradient): the op table's adamw cases (its
# skip), then the 30B-A3B cut beside transformers (whose fused AdamW does not clip either) and beside q3vl's update
# after the norm (the deck's clip 1); then train_checks.sh's part inbwd (every step's loss equal to the update after
# the norm, bound 0; a NaN skips one unit); then the update's stream below the model's priority (Q3VL_UPDATE_PRIO=low).
# 6 layers on an H200, 3 on an H100 (the 6 layers' fp32 state does not fit 80 GB).
source tools/gpu/call_lib.sh callE
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=3; [[ $mem -gt 100000 ]] && L=6
say "GPU memory $mem MiB: the 30B-A3B cut at $L layers"
ub="optim.clip=0 optim.update_in_backward=true"
Q3VL_OPS=adamw,sum_squares unit_gpu 'BackendOps.Fp32' 60  # the op table: adamw's skip on the GPU against the CPU
train_prof q30ub input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L $ub
hf_train hf30 150 --preset 30B-A3B --text-layers $L --batch 1 --seq 4096
ratio q30ub hf30 "30B-A3B x $L layers, 1 x 4096 tokens, the update in the backward"
left 110 && train_prof q30 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L &&
  ratio q30 hf30 "30B-A3B x $L layers, 1 x 4096 tokens, the update after the norm (clip 1)"
prof_rows q30ub q30
if left 150; then
  t1=$SECONDS
  timeout 150 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc inbwd > /dev/null 2>&1
  mkdir -p "$out/tc"; tar xzf /tmp/tc/results.tgz -C "$out/tc" 2>/dev/null
  say "train_checks inbwd $((SECONDS - t1)) s:"; grep -E "PASS|FAIL|ubnan|rc=[1-9]" "$out/tc/summary.txt" >> "$out/summary.txt"; pack
fi
left 110 && Q3VL_UPDATE_PRIO=low train_prof q30ublow input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 \
  model.text_layers=$L $ub && ratio q30ublow hf30 "30B-A3B x $L layers, the update in the backward below the model's priority"
if [[ $L = 6 ]] && left 50; then  # an H200: call C's A/B of the chain kernel's flags (the thirty-sixth session's)
  t1=$SECONDS
  timeout 45 /tmp/rt/bin/chain_bench 16 30 6,14,15,16,17,9,18 > "$out/chain_bench.txt" 2>&1
  say "chain_bench rc=$? $((SECONDS - t1)) s"; grep -E '^\| (chain|attn|none)' "$out/chain_bench.txt" >> "$out/summary.txt"; pack
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
