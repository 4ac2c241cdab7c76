#!/usr/bin/env bash
# `q3vl plan` and `parallel.layout = "auto"`: the 235B-A22B answers (nothing fits on 4 x 2 A100-80GB with 256 GiB
# hosts; the model states are ~3.77 TB), a 2B deck that fits one H200 with its deck lines, a serve plan, bad
# inputs named by key with a non-zero exit, and train choosing its own layout on CPU ranks. (The bytes themselves
# are checked against the allocators in tests/unit/test_plan.cpp and tests/mpi/test_plan.cpp.)
source "$(dirname "$0")/../lib.sh"
needs plan bin/q3vl || finish
big=(input/qwen3vl_235b.deck plan.nodes=4 plan.gpus_per_node=2 plan.gpu=A100-80GB plan.host_mem=256GiB)

out=$($q plan "${big[@]}" 2>&1); rc=$?
[[ $rc == 2 ]] && pass "235b-4x2-a100: exit 2 (nothing fits)" || bad "235b-4x2-a100: exit $rc, wanted 2: $out"
grep -q 'nothing fits on 4 x 2 A100-80GB' <<<"$out" && pass "235b-4x2-a100: says nothing fits" \
  || bad "235b-4x2-a100: no 'nothing fits' line: $out"
grep -qE '235\.[0-9]+ B parameters' <<<"$out" && pass "235b: parameter count" || bad "235b: parameter count: $out"
grep -qE '\(3\.7[0-9] TB\)' <<<"$out" && pass "235b: model states ~3.77 TB" || bad "235b: model states: $out"
grep -qE 'dominant, GiB per GPU: [a-z]' <<<"$out" && pass "235b: names what dominates" || bad "235b: dominant: $out"
# The smallest machine: more nodes than the 4 given, both with and without offload, offload needing fewer.
no=$(grep -oP 'no offload: +\K[0-9]+(?= node)' <<<"$out"); off=$(grep -oP 'with optimizer offload: +\K[0-9]+(?= node)' <<<"$out")
if [[ -n $no && -n $off ]] && ((no > 4 && off > 4 && off <= no)); then pass "235b: fewest nodes ($no, offload $off)"
else bad "235b: fewest nodes: '$no' / '$off': $out"; fi

# Expert parallelism is among the candidates, and the fewest-GPU answer without offload uses it (a rank then holds
# E/ep of each MoE layer's experts, which is what makes 235B fit on fewer GPUs).
grep -qE 'no offload: .*ZeRO-3, EP [0-9]+' <<<"$out" && pass "235b: fewest GPUs use expert parallelism" ||
  bad "235b: no EP layout in the fewest-GPU answer: $(grep -A3 'fewest nodes' <<<"$out")"

# LoRA on the same machine (input/qwen3vl_235b_lora.deck): only the adapters are trained, so the model states drop
# below 1 TB and it fits with the frozen base on the hosts (parallel.offload_params = frozen: the host engine's fp32
# shards, streamed up unit by unit; the deck lines say so); without offload it needs more nodes than the 4 given.
out=$($q plan input/qwen3vl_235b_lora.deck "${big[@]:1}" 2>&1); rc=$?
grep -qE '235\.[0-9]+ B parameters \(0\.0[0-9] B trained\)' <<<"$out" && grep -qE '\(0\.9[0-9] TB\)' <<<"$out" &&
  pass "235b-lora: only the adapters trained, 0.9x TB of model states" || bad "235b-lora: sizes: $(head -6 <<<"$out")"
no=$(grep -oP 'no offload: +\K[0-9]+(?= node)' <<<"$out")
[[ $rc == 0 ]] && grep -q 'fastest that fits: ZeRO-3 + optimizer offload + parameters on the host' <<<"$out" &&
  grep -qx 'offload_params = "frozen"' <<<"$out" && grep -qx 'offload_optimizer = "cpu"' <<<"$out" &&
  [[ -n $no ]] && ((no > 4)) && pass "235b-lora: fits 4 x 2 A100-80GB with the frozen base on the hosts ($no nodes without)" ||
  bad "235b-lora: exit $rc: $out"
# Host bytes by kind for the offloaded layouts: the frozen base's pinned bf16 copy dominates (its fp32 masters are
# released), so 128 GiB hosts now hold it and 64 GiB ones do not.
grep -q 'fastest that fits: ZeRO-3 + optimizer offload + parameters on the host' \
  <<<"$($q plan input/qwen3vl_235b_lora.deck "${big[@]:1}" plan.host_mem=128GiB 2>&1)" &&
  pass "235b-lora fits 128 GiB hosts (the base in bf16)" || bad "235b-lora on 128 GiB hosts: does not fit"
grep -qE 'per host rank: parameters \(pinned\) [0-9.]+' <<<"$($q plan input/qwen3vl_235b_lora.deck "${big[@]:1}" plan.host_mem=64GiB 2>&1)" &&
  pass "235b-lora on 64 GiB hosts: host bytes by kind" || bad "235b-lora on 64 GiB hosts: no host breakdown"
# Its job script runs the full fine-tune's steps with the LoRA deck (srun and squeue stand-ins record the calls).
mkdir -p $tmp/fake
printf '#!/bin/sh\necho "srun $*"\n' >$tmp/fake/srun
printf '#!/bin/sh\necho 1-00:00:00\n' >$tmp/fake/squeue
chmod +x $tmp/fake/*
job=$(PATH=$tmp/fake:$PATH SLURM_JOB_ID=7 SLURM_CPUS_PER_TASK=4 bash jobs/qwen3vl_235b_lora.slurm train.steps=5 2>&1)
grep -qx "srun --mpi=pmi2 --kill-on-bad-exit=1 bin/q3vl check input/qwen3vl_235b_lora.deck run.out_dir=out/qwen3vl_235b_lora" <<<"$job" &&
  grep -qx "srun .* bin/q3vl train input/qwen3vl_235b_lora.deck run.out_dir=out/qwen3vl_235b_lora model.hf=models/Qwen3-VL-235B-A22B-Instruct runtime.walltime=86400 train.steps=5" <<<"$job" &&
  pass "235b-lora job: check and train with the LoRA deck" || bad "235b-lora job: $job"

out=$($q plan input/bench_2b_gpu.deck plan.nodes=1 plan.gpus_per_node=1 plan.gpu=H200-141GB 2>&1); rc=$?
[[ $rc == 0 ]] && grep -q 'fastest that fits' <<<"$out" && grep -q '^zero_stage = ' <<<"$out" \
  && grep -q '^micro_batch = ' <<<"$out" && pass "2b-one-h200: fits, with deck lines" || bad "2b-one-h200: exit $rc: $out"
# The offloaded step's prediction follows the host's AdamW rate (plan.host_gbs, what `q3vl check` measures), and the
# delayed update (parallel.offload_update = delayed) hides it under the next step, in the deck lines too.
off_step() { $q plan input/bench_2b_gpu.deck plan.nodes=1 plan.gpus_per_node=1 "$@" 2>&1 |
  grep -oP 'with optimizer offload: .*step \K[0-9.]+(?= s)'; }
s100=$(off_step); s25=$(off_step plan.host_gbs=25); sd=$(off_step plan.host_gbs=25 parallel.offload_update=delayed)
dl=$($q plan input/bench_2b_gpu.deck plan.nodes=1 plan.gpus_per_node=1 parallel.offload_update=delayed plan.show=40 2>&1)
if [[ -n $s100 && -n $s25 && -n $sd ]] && $py -c "import sys; a,b,c=map(float,sys.argv[1:]); sys.exit(not (b > a + 1 and c < b - 0.3))" \
     "$s100" "$s25" "$sd" && grep -qE 'offload( of [0-9.]+ of the shard)? \(delayed update\)' <<<"$dl"; then
  pass "offload-step-follows-host-rate-and-delay ($s100 s, $s25 s at 25 GB/s, $sd s delayed)"
else bad "offload-step-follows-host-rate-and-delay: '$s100' '$s25' '$sd'"; fi
# Partial offload: without parallel.offload_ratio, a delayed update the step cannot hide gets the part it can (deck
# lines name it), which is faster than all of it on the host (offload_ratio = 1 given).
part=$($q plan input/bench_2b_gpu.deck plan.nodes=1 plan.gpus_per_node=1 plan.host_gbs=25 parallel.offload_update=delayed 2>&1)
sf=$(off_step plan.host_gbs=25 parallel.offload_update=delayed parallel.offload_ratio=1)
if grep -qP '^offload_ratio = 0\.[0-9]+$' <<<"$part" && [[ -n $sf ]] && $py -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]) - 0.2)" "$sd" "$sf"; then
  pass "offload-ratio-sized-by-the-plan ($sd s against $sf s all on the host)"
else bad "offload-ratio-sized-by-the-plan: '$sd' '$sf': $(grep -E 'offload_ratio|fastest' <<<"$part")"; fi
expect "serve-plan" 0 'KV capacity' $q plan input/qwen3vl_8b_sft.deck plan.for=serve plan.gpu=H100-80GB
# On one node of 2 GPUs: tensor parallelism, pipeline stages within the node, and the MoE model's whole experts
# (GPUs TP PP EP columns).
sp=$($q plan model.preset=30B-A3B model.dtype=bf16 plan.for=serve plan.gpus_per_node=2 plan.gpu=H200-141GB 2>&1)
grep -qE '^ +2 +1 +2 +1 +bf16' <<<"$sp" && grep -qE '^ +2 +2 +1 +1 +bf16' <<<"$sp" && grep -qE '^ +2 +2 +1 +2 +bf16' <<<"$sp" &&
  pass "serve-plan: TP 2, PP 2 and EP 2 on one node of 2 GPUs" || bad "serve-plan layouts on 2 GPUs: $sp"

expect "bad-gpu" 1 "plan.gpu" $q plan "${big[@]}" plan.gpu=B200
expect "zero-nodes" 1 "plan.nodes" $q plan "${big[@]}" plan.nodes=0
expect "no-unit" 1 'plan.host_mem = "256": a memory size needs a unit' $q plan "${big[@]}" plan.host_mem=256
expect "bad-unit" 1 "plan.gpu_mem = \"80 gigs\"" $q plan "${big[@]}" "plan.gpu_mem=80 gigs"

# train picks a layout itself and says which and why; the run uses it.
needs auto-train mpiexec && {
  mpiexec -n 2 $q train model.hf=tests/data/golden/dense_tied/model data.seq_len=32 train.global_batch=8 \
    train.steps=2 train.resume=never parallel.layout=auto run.out_dir="$tmp/auto" >"$tmp/auto.log" 2>&1; rc=$?
  chosen=$(grep -oP 'parallel.layout = auto: ZeRO-\K[123]' "$tmp/auto.log")
  if [[ $rc == 0 && -n $chosen ]] && grep -q "ZeRO stage $chosen" "$tmp/auto.log" && grep -q 'fastest predicted' "$tmp/auto.log"
  then pass "auto-train: chose ZeRO-$chosen and trained with it"
  else bad "auto-train: exit $rc: $(tail -5 "$tmp/auto.log")"; fi
}
finish
