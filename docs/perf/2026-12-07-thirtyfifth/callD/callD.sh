#!/usr/bin/env bash
# call D (thirty-fifth session, on call C's warm machine): call C's 30B-A3B server with the MoE link gave nothing in
# its 100 s and stayed up, so the runs after it found the GPU full. Here: the leftover processes ended; then
# `q3vl generate` on the 30B-A3B's shapes cut to 4 layers (one prompt: one-row decode steps) with the MoE link and
# without, each answer and log kept (a hang ends at 60 s); then, where both finished, one 30B-A3B stream each way.
source tools/gpu/call_lib.sh callD
pkill -9 -f 'rt/bin/q3vl' ; sleep 3
say "after pkill: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
"$q" synth synth.dir=/tmp/dd synth.train_samples=1 synth.eval_samples=1 synth.seed=3 run.timing=false >/dev/null 2>&1
ok=1
for m in 1 0; do
  t1=$SECONDS
  Q3VL_CHAIN_MOE=$m timeout 60 "$q" generate model.preset=30B-A3B model.text_layers=4 model.backend=cuda \
    model.dtype=bf16 generate.prompts=/tmp/dd/eval.jsonl generate.min_pixels=4096 generate.max_new_tokens=48 \
    generate.output=$out/gen_moe$m.jsonl > "$out/gen_moe$m.log" 2>&1
  rc=$?; say "generate 30B-A3B x 4 layers, Q3VL_CHAIN_MOE=$m: rc=$rc $((SECONDS - t1)) s: $(grep -iE 'decode|token' "$out/gen_moe$m.log" | tail -2 | tr '\n' ' ')"
  (( rc == 0 )) || ok=0
  pkill -9 -f 'rt/bin/q3vl'; pack
done
say "answers: $(cmp -s $out/gen_moe1.jsonl $out/gen_moe0.jsonl && echo equal || echo differ)"
head -c 600 $out/gen_moe1.jsonl >> "$out/summary.txt"; echo >> "$out/summary.txt"; head -c 600 $out/gen_moe0.jsonl >> "$out/summary.txt"
if (( ok )); then
  serve_one q30b_moe 30b 120 Q3VL_CHAIN_MOE=1; pkill -9 -f 'rt/bin/q3vl'
  serve_one q30b 30b 120; pkill -9 -f 'rt/bin/q3vl'
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
