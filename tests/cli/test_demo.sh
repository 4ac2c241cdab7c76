#!/usr/bin/env bash
# `make demo` shortened: the demo deck's pipeline (synth, prepare, train stopped half way and resumed from its
# checkpoint, generate from the newest checkpoint, score) on little data and few steps. Checks that the loss falls
# well below its start across the resume and that generation answers every held-out prompt in well-formed records.
source "$(dirname "$0")/../lib.sh"
run() { "$@" >>"$tmp/log" 2>&1 || { bad "$* failed: $(tail -5 "$tmp/log")"; return 1; }; }

deck=input/demo.deck
paths=(run.out_dir=$tmp/o synth.dir=$tmp/d prepare.input=$tmp/d/train.jsonl prepare.output=$tmp/s
       train.dataset=$tmp/s generate.checkpoint=$tmp/o/checkpoints generate.prompts=$tmp/d/eval.jsonl
       generate.output=$tmp/o/answers.jsonl run.timing=false)
short=(train.steps=30 train.global_batch=8 optim.warmup_steps=3 checkpoint.every=0)

run $q synth $deck "${paths[@]}" synth.train_samples=240 synth.eval_samples=8 &&
  run mpiexec -n 2 $q prepare $deck "${paths[@]}" &&
  run mpiexec -n 2 $q train $deck "${paths[@]}" "${short[@]}" train.stop_after=15 &&
  [[ $(ls $tmp/o/checkpoints | grep -c '^step_00000015') -eq 1 ]] && pass "stopped at step 15 with a checkpoint" ||
  bad "no checkpoint of step 15: $(ls $tmp/o/checkpoints 2>&1)"
run mpiexec -n 2 $q train $deck "${paths[@]}" "${short[@]}" train.resume=auto &&
  grep -q "resum.*step_00000015" "$tmp/log" && pass "resumed from step 15" ||
  bad "the second run did not resume from step 15: $(grep -i resum "$tmp/log")"

python3 - "$tmp/o/metrics.jsonl" <<'EOF' && pass "loss falls well below its start" || bad "loss: $(cut -c1-80 "$tmp/o/metrics.jsonl")"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steps = [r["step"] for r in recs]
assert steps == list(range(1, 31)), steps  # 1..15, then 16..30 after the resume
first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
print(f"loss {first:.3f} -> {last:.3f}")
assert last < 0.6 * first, (first, last)
EOF

run $q generate $deck "${paths[@]}" &&
  python3 - "$tmp/o/answers.jsonl" <<'EOF' && pass "8 well-formed answers from the checkpoint" || bad "answers: $(head -3 "$tmp/o/answers.jsonl")"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert [r["line"] for r in recs] == list(range(1, 9)), recs
for r in recs:
    assert isinstance(r["answer"], str) and r["stop"] in ("eos", "length"), r
EOF
o=$(tools/score_answers $tmp/o/answers.jsonl $tmp/d/eval.jsonl) && grep -q "^accuracy: .*(.*/8 " <<<"$o" &&
  pass "scorer reads the answers" || bad "scorer: $o"

finish
