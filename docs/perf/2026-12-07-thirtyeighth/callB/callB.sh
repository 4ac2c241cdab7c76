#!/usr/bin/env bash
# call B (thirty-eighth session, an H100 or H200): issue 30's update in the backward with SMs of its own
# (Q3VL_UPDATE_SMS=k: the update's kernels fill at most k SMs, the model's persistent grids, cuBLASLt's plans and the
# grouped expert GEMM, the other SMs; the units' checks adding the squares the backward took, dev::sum_slots). The
# 30B-A3B cut beside transformers (no clipping either) at the
# default (update after the norm, clip 1), in the backward with k = 0, 24 and 40; then train_checks.sh's inbwd part
# (every loss equal to the update after the norm, the share and the MoE golden model included); the op table's
# adamw, sum_squares and sum_slots cases.
# 6 layers on an H200, 3 on an H100 (the 6 layers' fp32 state does not fit 80 GB).
source tools/gpu/call_lib.sh callB
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=3; [[ $mem -gt 100000 ]] && L=6
say "GPU memory $mem MiB: the 30B-A3B cut at $L layers"
ub="optim.clip=0 optim.update_in_backward=true"
Q3VL_UPDATE_SMS=24 train_prof q30s24 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L $ub
train_prof q30 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L
prof_rows q30s24 q30
hf_train hf30 150 --preset 30B-A3B --text-layers $L --batch 1 --seq 4096
ratio q30s24 hf30 "30B-A3B x $L layers, the update in the backward on 24 SMs of its own"
ratio q30 hf30 "30B-A3B x $L layers, the update after the norm (clip 1: the default)"
left 90 && Q3VL_UPDATE_SMS=40 train_prof q30s40 input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30s40 hf30 "30B-A3B x $L layers, the update in the backward on 40 SMs of its own"
prof_rows q30s40
if left 100; then
  t1=$SECONDS
  timeout 140 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc inbwd > /dev/null 2>&1
  mkdir -p "$out/tc"; tar xzf /tmp/tc/results.tgz -C "$out/tc" 2>/dev/null
  say "train_checks inbwd $((SECONDS - t1)) s:"; grep -E "PASS|FAIL|ubnan|ubsms|ubmoe|rc=[1-9]" "$out/tc/summary.txt" >> "$out/summary.txt"; pack
fi
left 100 && train_prof q30ub input/bench_30b_a3b_gpu.deck 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30ub hf30 "30B-A3B x $L layers, the update in the backward, no SMs of its own" && prof_rows q30ub
left 50 && Q3VL_OPS=adamw,sum_squares,sum_slots unit_gpu 'BackendOps.Fp32' 45
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
