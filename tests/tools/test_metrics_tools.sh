#!/usr/bin/env bash
# tools/summarize and tools/plot_metrics on generated metrics.jsonl files (a run with a restart and skipped
# steps, a run with MFU) and on bad input; plus a real short `q3vl train` run when the mode exists.
source "$(dirname "$0")/../lib.sh"

mkdir -p $tmp/restarted $tmp/steady
$py tests/tools/make_metrics.py $tmp/restarted/metrics.jsonl 60 --restart-at 35 --resume-from 30 --skip 12,13,44
$py tests/tools/make_metrics.py $tmp/steady/metrics.jsonl 50 --mfu --seed 1
A=$tmp/restarted/metrics.jsonl B=$tmp/steady/metrics.jsonl

# --- summarize ---
out=$(tools/summarize $A $B 2>&1) || bad "summarize ran: $out"
final=$($py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(f'{r[-1][\"loss\"]:.4f}')" $A)
best=$($py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; l=[x for x in r if x['loss'] is not None]
b=min(l, key=lambda x: x['loss']); print(f'{b[\"loss\"]:.4f} @{b[\"step\"]}')" $A)
row=$(grep '^restarted ' <<<"$out")
read -r -a f <<<"$row"
[[ ${f[1]} == 60 ]] && pass "steps 60" || bad "steps: $row"
[[ ${f[6]} == 1 && ${f[7]} == 3 ]] && pass "1 restart, 3 skipped steps" || bad "restarts/skipped: $row"
[[ ${f[8]} == "$final" ]] && pass "final loss $final" || bad "final loss: want $final: $row"
[[ "${f[9]} ${f[10]}" == "$best" ]] && pass "best loss $best" || bad "best loss: want $best: $row"
[[ ${f[5]} == - ]] && pass "no MFU logged: -" || bad "MFU of a run without it: $row"
grep -qE '^steady +50 .* 5[0-9]\.[0-9]% +0 +0 ' <<<"$out" && pass "MFU mean of the steady run" || bad "steady row: $out"
md=$(tools/summarize --markdown --labels a,b $A $B 2>&1)
[[ $(sed -n 1p <<<"$md") == "| run | steps | tokens | wall | tokens/s | MFU | restarts | skipped | final loss | best loss |" &&
   $(grep -c '^| [ab] | ' <<<"$md") == 2 ]] && pass "markdown table" || bad "markdown: $md"

# --- plot_metrics ---
out=$(tools/plot_metrics -o $tmp/plots $A $B 2>&1) || bad "plot_metrics ran: $out"
for n in loss lr grad_norm tokens_per_s mfu memory; do
  p=$tmp/plots/$n.png
  if [[ -f $p && $(head -c 8 $p | od -An -tx1 | tr -d ' ') == 89504e470d0a1a0a && $(stat -c %s $p) -gt 10000 ]]; then
    pass "$n.png"
  else bad "$n.png missing or not a PNG: $out"; fi
done
out=$(tools/plot_metrics -o $tmp/plots2 $A 2>&1)
[[ ! -f $tmp/plots2/mfu.png ]] && grep -q "no model FLOPs utilisation" <<<"$out" && pass "no MFU plot without MFU" ||
  bad "MFU plot of a run without MFU: $out"

# --- bad input ---
: >$tmp/empty.jsonl
printf '{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n' >$tmp/trunc.jsonl
printf '{"step": 1}\nnot json\n{"step": 3}\n' >$tmp/garbage.jsonl
printf '{"loss": 1}\n' >$tmp/nostep.jsonl
for t in summarize plot_metrics; do
  expect "$t empty" 1 "empty.jsonl: empty log" tools/$t $tmp/empty.jsonl
  expect "$t truncated" 1 "trunc.jsonl:2: truncated line" tools/$t $tmp/trunc.jsonl
  expect "$t garbage" 1 "garbage.jsonl:2: not valid JSON" tools/$t $tmp/garbage.jsonl
  expect "$t no step" 1 "nostep.jsonl:1: no integer 'step'" tools/$t $tmp/nostep.jsonl
  expect "$t missing" 1 "cannot read .*none.jsonl" tools/$t $tmp/none.jsonl
done
expect "labels count" 1 "2 labels for 1 metrics" tools/summarize --labels a,b $A
expect "bad smooth" 1 "--smooth must be" tools/plot_metrics --smooth 1.5 $A

# --- a real short run, resumed from an earlier checkpoint (its steps go back: one restart) ---
if needs "real training run" bin/q3vl mpiexec; then
  train() { mpiexec -n 2 bin/q3vl train model.hf=tests/data/golden/moe/model run.out_dir=$tmp/real data.seq_len=64 \
            train.global_batch=2 train.synthetic_samples=8 train.steps=4 checkpoint.every=2 checkpoint.keep=5 "$@" \
            >>$tmp/train.log 2>&1 || bad "q3vl train $*: $(tail -3 $tmp/train.log)"; }
  train && train train.resume=$tmp/real/checkpoints/step_00000002.h5
  out=$(tools/summarize $tmp/real/metrics.jsonl 2>&1)
  grep -qE '^real +4 .* 1 +0 +[0-9.]+ ' <<<"$out" && pass "real run: 4 steps, 1 restart, 0 skipped" || bad "real run: $out"
  out=$(tools/plot_metrics -o $tmp/real_plots $tmp/real/metrics.jsonl 2>&1)
  [[ -f $tmp/real_plots/loss.png && -f $tmp/real_plots/memory.png ]] && pass "real run: plots" || bad "real run plots: $out"
  # The memory plot takes the nested memory figures too, and not the gather traffic.
  keys=$(PYTHONPATH=tools $py -c "from q3vl_tools.metrics import load_run
r = load_run('$tmp/real/metrics.jsonl'); print(*r.memory_keys()); print(r.series('memory_mib.zero_state')[2][0] > 0)")
  [[ $keys == $'memory_mib.activations memory_mib.working memory_mib.zero_state rss_mib\nTrue' ]] &&
    pass "real run: memory figures" || bad "real run memory figures: $keys"
fi

finish
