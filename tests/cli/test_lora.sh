#!/usr/bin/env bash
# LoRA end to end on the CPU (tests/data/golden/dense_tied/model as the frozen base, the synthetic dataset): 1, 2 and
# 4 ranks give the same losses and adapters; a stopped and resumed run is bitwise a straight one; checkpoints hold
# the adapters and their AdamW state only; a resume against another base (or a full fine-tuning checkpoint) is
# refused; tools/export_hf --lora writes a PEFT adapter folder that eval loads back (lora.adapter), giving the loss
# of tools/export_hf --merge's folded model and adapter gradients under PEFT's names; generate and serve (also
# tensor-parallel: adapters folded for inference) answer alike from a LoRA checkpoint; a MoE's
# router adapters train the same under expert parallelism; an adapter on the tied LM head (module lm_head) trains
# alike on 1 and 2 ranks, exports under PEFT's name and merges into an untied head (the embeddings unchanged), and
# serve under TP folds it into an untied head giving generate's answers; a PEFT folder with the head's full weights
# (lm_head.base_layer.weight, as PEFT saves it) replaces the base's in eval and train, and export keeps or merges
# them; bad [lora] keys are refused naming the key.
source "$(dirname "$0")/../lib.sh"
g=tests/data/golden/dense_tied
model=$g/model
common=(model.hf=$model data.seq_len=32 train.global_batch=8 train.steps=6 train.lr=2e-3 train.micro_batch=2
        train.resume=never lora.rank=4 lora.alpha=8
        "lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,linear_fc1,merger.linear_fc2")
train() {
  local name=$1 np=$2; shift 2
  mpiexec -n "$np" $q train "${common[@]}" run.out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
}
# ok_run, ckpt, cmp_losses and cmp_ckpt: tests/lib.sh.

# (a) 1, 2 and 4 ranks: the same losses (1e-5) and adapters; the loss falls; only adapters are trained and kept.
train r1 1; ok_run $? r1 && train r2 2; ok_run $? r2 && train r4 4; ok_run $? r4 && {
  cmp_losses r1 r2 1e-5 6 && cmp_losses r1 r4 1e-5 6 && pass "1/2/4 ranks: same losses" || bad "1/2/4 ranks: losses differ"
  cmp_ckpt "$(ckpt r1)" "$(ckpt r4)" 1e-5 && pass "1/4 ranks: same adapters and moments" || bad "1/4 ranks: adapters differ"
  $py - "$(ckpt r2)" "$tmp/r2/metrics.jsonl" <<'PY' && pass "checkpoint: adapters + AdamW state only" || bad "checkpoint contents"
import h5py, json, sys
names = []
h5py.File(sys.argv[1]).visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
assert names and all(".lora_A." in n or ".lora_B." in n for n in names), [n for n in names if ".lora_" not in n][:3]
kinds = {n.split("/")[0] + "/" + n.split("/")[1] if n.startswith("optim") else "model" for n in names}
assert kinds == {"model", "optim/exp_avg", "optim/exp_avg_sq"}, kinds
assert sum(n.startswith("model/") and ".lora_A." in n for n in names) >= 14 + 2 + 2 + 1, len(names)
m = [json.loads(l) for l in open(sys.argv[2])]
assert m[-1]["loss"] < m[0]["loss"], (m[0]["loss"], m[-1]["loss"])
PY
  # ZeRO-1 (the model's full gradient buffer, base part never written) and block recomputation agree too.
  train z1 2 parallel.zero_stage=1 lora.dropout=0.1; ok_run $? z1 && train z3 2 lora.dropout=0.1 &&
    cmp_ckpt "$(ckpt z1)" "$(ckpt z3)" 1e-5 && pass "ZeRO-1 = ZeRO-3 with dropout" || bad "ZeRO-1 vs ZeRO-3 differ"
  train rc 2 train.recompute=block lora.dropout=0.1; ok_run $? rc && {
    cmp_ckpt "$(ckpt rc)" "$(ckpt z3)" 0 && pass "recompute: bitwise, dropout masks redrawn" || bad "recompute differs"
  }
  grep -q "lora: rank 4, alpha 8" "$tmp/r1.log" && grep -q "full fine-tuning would be" "$tmp/r1.log" &&
    pass "memory report counts adapters" || bad "memory report: no lora line in $(grep -c . "$tmp/r1.log") lines"
}

# (a2) The frozen base on the host (parallel.offload_params = frozen, with the optimizer offloaded, issue 29): no
# parameter copy on the device, every gather streams its shard up from the host masters: bitwise the same adapters and
# losses at 1 rank, 2 ranks with dropout (ZeRO-3) and ZeRO-1; refused with nothing frozen or without the optimizer.
hostbase=(parallel.offload_optimizer=cpu parallel.offload_params=frozen)
for c in "f1 r1 1" "f3 z3 2 lora.dropout=0.1" "fz1 z1 2 parallel.zero_stage=1 lora.dropout=0.1"; do
  set -- $c
  train "$1" "$3" "${hostbase[@]}" "${@:4}"; ok_run $? "$1" && grep -q "parameters streamed up" "$tmp/$1.log" &&
    cmp_losses "$1" "$2" 0 6 && cmp_ckpt "$(ckpt "$1")" "$(ckpt "$2")" 0 && pass "frozen base on the host: $1 = $2 bitwise" ||
    bad "frozen base on the host: $1 vs $2"
done
# With bf16 gathers the base streams from a pinned bf16 copy on the host and its fp32 masters are given back to the
# OS: bitwise the same run with bf16 gathers and the base on the device, at 1 rank, 2 ranks (ZeRO-3) and ZeRO-1, and a
# resume (its checkpoints are written after the release).
gb=(parallel.gather_dtype=bf16)
for c in "gh1 gd1 1" "gh3 gd3 2 lora.dropout=0.1" "ghz1 gdz1 2 parallel.zero_stage=1"; do
  set -- $c
  train "$2" "$3" "${gb[@]}" "${@:4}" && train "$1" "$3" "${gb[@]}" "${hostbase[@]}" "${@:4}"
  ok_run $? "$1" && grep -q "fp32 masters released" "$tmp/$1.log" && grep -q "pinned bf16 copy" "$tmp/$1.log" &&
    cmp_losses "$1" "$2" 0 6 && cmp_ckpt "$(ckpt "$1")" "$(ckpt "$2")" 0 &&
    pass "frozen base on the host in bf16: $1 = $2 bitwise" || bad "frozen base on the host in bf16: $1 vs $2"
done
train ghs 2 "${gb[@]}" "${hostbase[@]}" lora.dropout=0.1 train.stop_after=3; rc=$?
if [[ $rc -eq 0 || $rc -eq 3 ]]; then
  train ghs 2 "${gb[@]}" "${hostbase[@]}" lora.dropout=0.1 train.resume=auto; ok_run $? ghs &&
    cmp_ckpt "$(ckpt ghs)" "$(ckpt gd3)" 0 && pass "frozen base on the host in bf16: stop and resume bitwise" ||
    bad "frozen base on the host in bf16: resume differs"
else
  bad "frozen base on the host in bf16: stopped run rc=$rc"
fi
expect "offload_params: nothing frozen" 1 'parallel.offload_params = "frozen" but nothing is frozen' \
  $q train model.hf=$model train.steps=1 "${hostbase[@]}" run.out_dir="$tmp/nf"
expect "offload_params: needs the optimizer offloaded" 1 \
  'parallel.offload_params = "frozen" needs parallel.offload_optimizer = "cpu"' \
  $q train "${common[@]}" parallel.offload_params=frozen run.out_dir="$tmp/nf"
expect "offload_params with a partial offload" 1 \
  'parallel.offload_ratio below 1 with parallel.offload_params = "frozen" is not supported' \
  $q train "${common[@]}" "${hostbase[@]}" parallel.offload_ratio=0.5 run.out_dir="$tmp/nf"

# (b) stop after 3 steps, resume (on another rank count too): bitwise the straight run on the same count.
train s2 2 train.stop_after=3; rc=$?
if [[ $rc -eq 0 || $rc -eq 3 ]]; then
  cp -r "$tmp/s2" "$tmp/s4"
  train s2 2 train.resume=auto; ok_run $? s2 && {
    cmp_ckpt "$(ckpt s2)" "$(ckpt r2)" 0 && pass "stop and resume: bitwise" || bad "stop and resume differs"
  }
  train s4 4 train.resume=auto; ok_run $? s4 && {
    cmp_ckpt "$(ckpt s4)" "$(ckpt r2)" 1e-5 && pass "resume on 4 ranks from 2" || bad "resume on another rank count"
  }
  # (c) another base (one weight changed) is refused, and so is a full fine-tuning checkpoint.
  mkdir -p "$tmp/other" && cp $model/* "$tmp/other/" && $py - "$tmp/other/model.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
    e = h["model.language_model.layers.0.mlp.down_proj.weight"]
    f.seek(8 + n + e["data_offsets"][0]); b = bytearray(f.read(4)); b[3] ^= 0x01; f.seek(-4, 1); f.write(b)
PY
  expect "resume against another base refused" 1 "another base model" \
    mpiexec -n 2 $q train "${common[@]}" run.out_dir="$tmp/s2" train.resume="$(ckpt s2)" model.hf="$tmp/other"
else
  bad "stop_after: exit $rc: $(tail -5 "$tmp/s2.log")"
fi
mpiexec -n 1 $q train model.hf=$model data.seq_len=32 train.global_batch=8 train.steps=1 train.micro_batch=2 \
  train.resume=never run.out_dir="$tmp/full" >"$tmp/full.log" 2>&1; ok_run $? full && expect "full checkpoint refused" 1 \
  "full fine-tuning checkpoint but lora.rank > 0" mpiexec -n 1 $q train "${common[@]}" run.out_dir="$tmp/x" \
  train.resume="$(ckpt full)"

# (d) export --lora: a PEFT folder; eval with lora.adapter equals eval of the --merge export (1e-5), and its grads
# are the adapters' under PEFT names.
if [[ -f "$(ckpt r2 2>/dev/null)" ]]; then
  tools/export_hf --lora "$(ckpt r2)" "$tmp/adapter" >"$tmp/exp.log" 2>&1 &&
    tools/export_hf --merge --dtype fp32 "$(ckpt r2)" "$tmp/merged" >>"$tmp/exp.log" 2>&1 ||
    bad "export: $(tail -3 "$tmp/exp.log")"
  $py - "$tmp/adapter" <<'PY' && pass "export --lora: PEFT adapter folder" || bad "export --lora folder"
import json, sys, os
sys.path.insert(0, "tools")
from q3vl_tools import safetensors
c = json.load(open(os.path.join(sys.argv[1], "adapter_config.json")))
assert c["peft_type"] == "LORA" and c["r"] == 4 and c["lora_alpha"] == 8, c
t = safetensors.read_header(os.path.join(sys.argv[1], "adapter_model.safetensors"))
names = [n for n in t if n != "__metadata__"]
assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in names, names[:3]
assert all(n.startswith("base_model.model.") and (n.endswith(".lora_A.weight") or n.endswith(".lora_B.weight")) for n in names)
assert len(names) == 2 * len(c["target_modules"]), (len(names), len(c["target_modules"]))
PY
  scalar() { h5dump -m '%.17g' -d "$2" "$1" | awk '/\(0\)/ {print $2}'; }
  $q eval model.hf=$model lora.adapter="$tmp/adapter" eval.batch=$g/batch.h5 eval.output="$tmp/ea.h5" \
    eval.grads=true >"$tmp/ea.log" 2>&1 && $q eval model.hf="$tmp/merged" eval.batch=$g/batch.h5 \
    eval.output="$tmp/em.h5" >"$tmp/em.log" 2>&1 && $q eval model.hf=$model eval.batch=$g/batch.h5 \
    eval.output="$tmp/eb.h5" >"$tmp/eb.log" 2>&1 && $py - "$tmp/ea.h5" "$tmp/em.h5" "$tmp/eb.h5" <<'PY' \
    && pass "export -> lora.adapter round trip equals --merge" || bad "round trip: $(tail -2 "$tmp/ea.log")"
import h5py, numpy as np, sys
a, m, b = (h5py.File(p) for p in sys.argv[1:])
la, lm, lb = (float(f["loss"][()]) for f in (a, m, b))
assert abs(la - lm) <= 1e-5 * abs(lm), (la, lm)
assert abs(la - lb) > 1e-4, ("the adapters change nothing", la, lb)
d = np.abs(a["logits"][()] - m["logits"][()]).max()
assert d < 1e-4, d
g = []
a["grads"].visititems(lambda n, o: g.append(n) if isinstance(o, h5py.Dataset) else None)
assert g and all(n.startswith("base_model.model.") and ".lora_" in n for n in g), g[:3]
assert any(np.abs(a["grads"][n][()]).max() > 0 for n in g if ".lora_A." in n)
PY
fi

# generate (a base with the Qwen vocabulary: model.preset=tiny, random init): from the LoRA checkpoint (base drawn
# from its deck's seed) and from the base + the exported adapter folder, the same answers.
$q synth synth.dir="$tmp/d" synth.train_samples=1 synth.eval_samples=3 >/dev/null 2>&1
gen() { $q generate generate.prompts="$tmp/d/eval.jsonl" generate.min_pixels=4096 generate.max_new_tokens=5 \
          run.timing=false "$@" >>"$tmp/gen.log" 2>&1; }
mpiexec -n 2 $q train model.preset=tiny data.seq_len=64 train.global_batch=4 train.steps=2 train.lr=1e-2 \
  train.resume=never lora.rank=2 run.seed=5 run.out_dir="$tmp/t" \
  lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head >"$tmp/t.log" 2>&1 &&
  tools/export_hf --lora "$(ckpt t)" "$tmp/tad" >>"$tmp/gen.log" 2>&1 &&
  gen generate.checkpoint="$tmp/t/checkpoints" generate.output="$tmp/g1.jsonl" &&
  gen model.preset=tiny run.seed=5 lora.adapter="$tmp/tad" generate.output="$tmp/g2.jsonl" &&
  $py - "$tmp"/g1.jsonl "$tmp"/g2.jsonl <<'PY' && pass "generate: LoRA checkpoint = base + adapter folder" ||
import json, sys
a, b = ([json.loads(l)["answer"] for l in open(p)] for p in sys.argv[1:])
assert len(a) == 3 and a == b, (a, b)
PY
  bad "generate with adapters: $(tail -3 "$tmp/t.log" "$tmp/gen.log")"
# Inference runs without adapters: generate folded them (the tied head's into an untied copy) first; the folded
# model's logits equal the adapters' (Lora.MergedEqualsAdapterForward), and eval's and export's too (d).
[[ -f $tmp/g1.jsonl ]] && grep -q "LoRA adapters folded into the base for inference (the LM head's into an untied" \
  "$tmp/gen.log" && pass "generate: LoRA checkpoint folded (the tied head's into an untied copy)" ||
  bad "generate with adapters: no fold line: $(grep folded "$tmp/gen.log")"

# serve (the model_source/load_model generate uses): the LoRA checkpoint's greedy answers are generate's, on one rank
# and under tensor parallelism over 2 (the adapters folded into the base before the split).
no_client=$(node_client_missing)
[[ -f $tmp/g1.jsonl ]] || no_client=${no_client:-"no generate answers to compare with (generate failed above)"}
if [[ -z $no_client ]]; then
  for n in 1 2; do
    mpiexec -n $n $q serve serve.checkpoint="$tmp/t/checkpoints" serve.port=0 \
      serve.min_pixels=4096 serve.model_name=q3vl-tiny serve.kv_mib=8 run.timing=false >"$tmp/serve$n.log" 2>&1 &
    spid=$!
    if port=$(server_port "$tmp/serve$n.log" $spid); then
      MAX_TOKENS=5 node tests/cli/serve_client.mjs $port q3vl-tiny answers "$tmp/d/eval.jsonl" data >"$tmp/s$n.jsonl" \
        2>"$tmp/serr.log"
      $py - "$tmp/g1.jsonl" "$tmp/s$n.jsonl" <<'PY' && pass "serve (TP $n): LoRA checkpoint answers = generate's" ||
import json, sys
gen = {r["line"]: r["answer"] for r in map(json.loads, open(sys.argv[1]))}
got = [json.loads(l) for l in open(sys.argv[2]) if '"line"' in l]
assert len(got) == 3 and all(r.get("answer") == gen[r["line"]] for r in got), (got, gen)
PY
        bad "serve TP $n with adapters: $(head -c 400 "$tmp/s$n.jsonl") $(tail -3 "$tmp/serr.log")"
      grep -q "LoRA adapters folded into the base for serving (the LM head's into an untied" \
        "$tmp/serve$n.log" || bad "serve TP $n: no fold (with the tied head untied) logged"
    else
      bad "serve TP $n with adapters did not come up: $(tail -5 "$tmp/serve$n.log")"
    fi
    kill -TERM $spid 2>/dev/null; wait $spid 2>/dev/null
  done
else
  for n in 1 2; do skip "serve (TP $n): LoRA checkpoint answers = generate's" "$no_client"; done
fi

# (f) MoE (8 experts, top-3): adapters on attention and the router, the experts frozen (null gradients per expert);
# expert parallelism (EP 2 on 2 ranks, EP 4 on 4) trains the same adapters as EP 1.
moe=$tmp/moe8
if $py tests/tools/make_hf_model.py tests/data/golden/moe/model/config.json "$moe" num_local_experts=8 \
     num_experts_per_tok=3 >/dev/null; then
  mtrain() {
    local name=$1 np=$2; shift 2
    mpiexec -n "$np" $q train model.hf=$moe data.seq_len=32 train.global_batch=8 train.steps=6 train.lr=2e-3 \
      train.micro_batch=2 train.resume=never lora.rank=4 lora.alpha=8 lora.targets=q_proj,v_proj,o_proj,mlp.gate \
      run.out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
  }
  mtrain m1 2 parallel.ep=1; ok_run $? m1 && mtrain m2 2 parallel.ep=2; ok_run $? m2 &&
    mtrain m4 4 parallel.ep=4; ok_run $? m4 && {
    cmp_losses m2 m1 1e-5 6 && cmp_losses m4 m1 1e-5 6 && pass "MoE LoRA: EP 2 and 4 = EP 1 losses" ||
      bad "MoE LoRA under EP: losses differ"
    cmp_ckpt "$(ckpt m4)" "$(ckpt m1)" 1e-5 && pass "MoE LoRA: EP 4 = EP 1 adapters" || bad "MoE LoRA EP: adapters differ"
  }
  # The frozen experts streamed from the host (their own units, sharded over the expert replicas): bitwise EP 2's run.
  mtrain mf2 2 parallel.ep=2 parallel.offload_optimizer=cpu parallel.offload_params=frozen; ok_run $? mf2 &&
    cmp_losses mf2 m2 0 6 && cmp_ckpt "$(ckpt mf2)" "$(ckpt m2)" 0 && pass "MoE LoRA, EP 2: frozen base on the host, bitwise" ||
    bad "MoE LoRA, EP 2: frozen base on the host differs"
else
  bad "make MoE model"
fi

# (g) the tied LM head's adapter (lm_head): 1 = 2 = 4 ranks, resume; PEFT's name; --merge unties the head (embeddings as the
# base's, lm_head.weight = embeddings + scale B A) and its eval equals base + adapter folder's.
htrain() { train "$@" lora.targets=q_proj,v_proj,lm_head train.steps=3; }
htrain h1 1; ok_run $? h1 && htrain h2 2; ok_run $? h2 && htrain h4 4; ok_run $? h4 && {
  cmp_losses h1 h2 1e-5 3 && cmp_losses h1 h4 1e-5 3 && pass "lm_head adapter: 1 = 2 = 4 ranks" ||
    bad "lm_head adapter: losses differ"
  # Resume: with dropout (masks differ by rank count, by design) on the same count bitwise; without, on 4 from 2.
  htrain hs 2 train.stop_after=2 lora.dropout=0.1; htrain hs 2 train.resume=auto lora.dropout=0.1 &&
    htrain hd 2 lora.dropout=0.1 && cmp_ckpt "$(ckpt hs)" "$(ckpt hd)" 0 &&
    pass "lm_head adapter with dropout: stop and resume bitwise" || bad "lm_head adapter: resume with dropout differs"
  htrain hx 2 train.stop_after=2; htrain hx 4 train.resume=auto && cmp_ckpt "$(ckpt hx)" "$(ckpt h4)" 1e-5 &&
    pass "lm_head adapter: stopped on 2 ranks, resumed on 4 = straight 4" || bad "lm_head adapter: resume on 4 differs"
  tools/export_hf --lora "$(ckpt h2)" "$tmp/had" >"$tmp/hexp.log" 2>&1 &&
    tools/export_hf --merge --dtype fp32 "$(ckpt h2)" "$tmp/hmerged" >>"$tmp/hexp.log" 2>&1 &&
    $q eval model.hf=$model lora.adapter="$tmp/had" eval.batch=$g/batch.h5 eval.output="$tmp/ha.h5" >"$tmp/ha.log" 2>&1 &&
    $q eval model.hf="$tmp/hmerged" eval.batch=$g/batch.h5 eval.output="$tmp/hm.h5" >"$tmp/hm.log" 2>&1 &&
    $py - "$tmp/had" "$tmp/hmerged" $model "$tmp/ha.h5" "$tmp/hm.h5" "$(ckpt h2)" <<'PY' &&
import h5py, json, os, sys
import numpy as np
sys.path.insert(0, "tools")
from q3vl_tools import safetensors
ad, merged, base, ea, em, ck = sys.argv[1:]
names = [n for n in safetensors.read_header(os.path.join(ad, "adapter_model.safetensors")) if n != "__metadata__"]
assert "base_model.model.lm_head.lora_A.weight" in names and "base_model.model.lm_head.lora_B.weight" in names, names
assert "lm_head" in json.load(open(os.path.join(ad, "adapter_config.json")))["target_modules"]
c = json.load(open(os.path.join(merged, "config.json")))
assert json.load(open(os.path.join(base, "config.json"))).get("tie_word_embeddings") and not c["tie_word_embeddings"], c
m, b = ({n: x.f32() for n, x in safetensors.open_dir(d).items()} for d in (merged, base))
e = "model.language_model.embed_tokens.weight"
assert "lm_head.weight" in m and "lm_head.weight" not in b
assert np.array_equal(np.asarray(m[e], np.float32), np.asarray(b[e], np.float32)), "the embeddings changed"
k = h5py.File(ck)
A, B = k["model/lm_head.lora_A.weight"][()], k["model/lm_head.lora_B.weight"][()]
assert np.abs(B).max() > 0, "B never trained"
want = b[e].astype(np.float64) + 2.0 * (B.astype(np.float64) @ A.astype(np.float64))  # alpha 8 / rank 4
assert np.abs(m["lm_head.weight"] - want).max() < 1e-6
la, lm = (float(h5py.File(p)["loss"][()]) for p in (ea, em))
assert abs(la - lm) <= 1e-5 * abs(lm), (la, lm)
PY
    pass "lm_head adapter: PEFT name, --merge unties the head, eval equal" ||
    bad "lm_head adapter export/merge: $(tail -3 "$tmp/hexp.log" "$tmp/ha.log")"
}

# (h) PEFT saves an adapter on lm_head with the layer's full weights (lm_head.base_layer.weight): they replace the base's
# (this tied model's embeddings) in eval and in train's sliced start-up, exactly as a base holding them; a wrong shape
# is refused naming file and tensor; export --lora keeps them beside the adapters, --merge applies them.
if [[ -d $tmp/had ]] && $py - "$tmp/had" $model "$tmp/hbl" "$tmp/hbase" "$tmp/hbad" <<'PY'; then
import os, shutil, sys
import numpy as np
sys.path.insert(0, "tools")
from q3vl_tools import safetensors
had, model, hbl, hbase, hbad = sys.argv[1:]
e, head = "model.language_model.embed_tokens.weight", "base_model.model.lm_head.base_layer.weight"
base = safetensors.open_dir(model)
new = (1.5 * base[e].f32() + 0.01 * np.random.default_rng(1).standard_normal(base[e].shape)).astype(np.float32)
ad = safetensors.read_header(os.path.join(had, "adapter_model.safetensors"))
def folder(dst, extra):
    os.makedirs(dst)
    shutil.copy(os.path.join(had, "adapter_config.json"), dst)
    safetensors.write_file(os.path.join(dst, "adapter_model.safetensors"),
                           [(n, x.shape, x.f32) for n, x in sorted(ad.items())] + extra, "F32")
folder(hbl, [(head, list(new.shape), lambda: new)])
folder(hbad, [(head, [new.shape[0], new.shape[1] - 1], lambda: new[:, 1:])])
shutil.copytree(model, hbase)
safetensors.write_file(os.path.join(hbase, "model.safetensors"),
                       [(n, x.shape, (lambda: new) if n == e else x.f32) for n, x in sorted(base.items())], "F32")
PY
  head=base_model.model.lm_head.base_layer.weight
  ev() { local o=$1; shift; $q eval eval.batch=$g/batch.h5 eval.output="$tmp/$o.h5" "$@" >"$tmp/$o.log" 2>&1; }
  same() { $py - "$@" <<'PY'; }  # same TOL A.h5 B.h5 [DIFFERENT.h5]: losses equal to TOL, and unlike the third
import h5py, sys
tol, (a, b, *c) = float(sys.argv[1]), (float(h5py.File(p)["loss"][()]) for p in sys.argv[2:])
assert abs(a - b) <= tol * abs(b), (a, b)
assert all(abs(a - x) > 1e-4 for x in c), ("the base weights change nothing", a, c)
PY
  ev hbe model.hf=$model lora.adapter="$tmp/hbl" && ev hbr model.hf="$tmp/hbase" lora.adapter="$tmp/had" &&
    grep -q "replaces the base's model.language_model.embed_tokens.weight by $head" "$tmp/hbe.log" &&
    same 0 "$tmp/hbe.h5" "$tmp/hbr.h5" "$tmp/ha.h5" && pass "eval: lm_head.base_layer.weight replaces the tied embeddings" ||
    bad "eval with lm_head.base_layer.weight: $(tail -3 "$tmp/hbe.log")"
  expect "lm_head.base_layer.weight of another shape refused" 1 \
    "hbad/adapter_model.safetensors: tensor $head has shape \[256,63\], but it replaces the base model's model.language_model.embed_tokens.weight .*\[256,64\]" \
    $q eval model.hf=$model lora.adapter="$tmp/hbad" eval.batch=$g/batch.h5 eval.output="$tmp/o.h5"
  # 2 ranks: each reads its shard of the embeddings from the folder; the same run as on the replaced base, bitwise.
  htrain hb 2 lora.adapter="$tmp/hbl"; ok_run $? hb && htrain hr 2 model.hf="$tmp/hbase" lora.adapter="$tmp/had"
  ok_run $? hr && cmp_losses hb hr 0 3 && cmp_ckpt "$(ckpt hb)" "$(ckpt hr)" 0 &&
    pass "train from the folder = train on the replaced base (bitwise)" || bad "train with lm_head.base_layer.weight"
  if [[ -f $(ckpt hb 2>/dev/null) ]]; then
    tools/export_hf --lora "$(ckpt hb)" "$tmp/hbad2" >"$tmp/hbx.log" 2>&1 &&
      tools/export_hf --merge --dtype fp32 "$(ckpt hb)" "$tmp/hbm" >>"$tmp/hbx.log" 2>&1 &&
      tools/export_hf --merge --dtype fp32 "$(ckpt hr)" "$tmp/hrm" >>"$tmp/hbx.log" 2>&1 &&
      ev hbe2 model.hf=$model lora.adapter="$tmp/hbad2" && ev hbm model.hf="$tmp/hbm" && ev hrm model.hf="$tmp/hrm" &&
      grep -q "with the base weights of $tmp/hbl" "$tmp/hbx.log" && same 0 "$tmp/hbm.h5" "$tmp/hrm.h5" &&
      same 1e-5 "$tmp/hbe2.h5" "$tmp/hbm.h5" && pass "export: --lora keeps lm_head.base_layer.weight, --merge applies it" ||
      bad "export with lm_head.base_layer.weight: $(tail -3 "$tmp/hbx.log")"
    mv "$tmp/hbl" "$tmp/hbl.away"
    expect "export: the starting PEFT folder gone" 1 "lora.adapter = '$tmp/hbl'.*not here" \
      tools/export_hf --lora "$(ckpt hb)" "$tmp/o8"
    mv "$tmp/hbl.away" "$tmp/hbl"
  fi
else
  bad "PEFT folder with lm_head.base_layer.weight: none made"
fi

# (e) bad [lora] keys name the key.
expect "unknown lora key" 1 "lora.rnak.*did you mean 'lora.rank'" $q train model.hf=$model lora.rnak=4
expect "targets matching nothing" 1 "lora.targets: pattern 'qq_proj'" $q train "${common[@]}" \
  lora.targets=q_proj,qq_proj run.out_dir="$tmp/bad"
expect "lora key without rank" 1 "lora.alpha is set but lora.rank = 0" $q train model.hf=$model lora.alpha=4 \
  run.out_dir="$tmp/bad"
expect "adapter of another rank" 1 "lora.rank = 8 but the adapter" $q eval model.hf=$model lora.rank=8 \
  lora.adapter="$tmp/adapter" eval.batch=$g/batch.h5 eval.output="$tmp/o.h5"
finish
