#!/usr/bin/env bash
# Videos given as lists of frame images (issue 31) through `q3vl prepare`, `q3vl train` and `q3vl generate` on a
# random tiny model: the shards hold the videos, training on them runs, generate answers a video prompt with the
# host and the device model alike, serve answers video_url parts as generate does (one rank and TP = 2, prefix
# cache, bad videos), and bad video parts fail naming file, line and part. The processor and model
# parity are tests/unit/test_video*.cpp; prepare's round trip is tests/mpi/test_prepare.cpp.
source "$(dirname "$0")/../lib.sh"
run() { "$@" >"$tmp/log" 2>&1 || { bad "$* failed: $(tail -5 "$tmp/log")"; return 1; }; }

# Frames: synth's pictures (all one size), 8 of them as a clip.
run $q synth synth.dir=$tmp/d synth.train_samples=8 synth.eval_samples=1 synth.seed=5 || { finish; exit; }
frames=$(ls $tmp/d/images | head -8 | sed 's|^|"images/|; s|$|"|' | paste -sd, -)
cat >$tmp/d/video.jsonl <<EOF
{"messages": [{"role": "user", "content": [{"type": "video", "video": [$frames]}, {"type": "text", "text": "What moves?"}]}, {"role": "assistant", "content": "A shape."}]}
{"messages": [{"role": "user", "content": [{"type": "image", "image": "images/$(ls $tmp/d/images | head -1)"}, {"type": "video", "video": [$frames], "fps": 4, "max_frames": 4}, {"type": "text", "text": "And here?"}]}, {"role": "assistant", "content": "The same."}]}
{"messages": [{"role": "user", "content": "No video."}, {"role": "assistant", "content": "Fine."}]}
EOF

# prepare: three samples, two videos, one image; the manifest carries the video settings.
run $q prepare prepare.input=$tmp/d/video.jsonl prepare.output=$tmp/ds prepare.min_pixels=4096 &&
  grep -q "3 sample(s) .* 1 images, 2 videos" $tmp/log && pass "prepare: 3 samples, 1 image, 2 videos" ||
  bad "prepare summary: $(grep prepare: $tmp/log)"
$py - "$tmp/ds" <<'EOF' && pass "shards hold the sampled frames, grids and source indices" || bad "shard contents"
import h5py, json, sys, glob
man = json.load(open(sys.argv[1] + "/index.json"))
assert man["videos"] == 2 and man["video"]["fps"] == 2 and man["video"]["max_frames"] == 768, man
grids, idx = [], []
for f in sorted(glob.glob(sys.argv[1] + "/shard-*.h5")):
    h = h5py.File(f)
    grids += h["video_grid"][()].tolist()
    idx += h["frame_index"][()].tolist()
# 8 frames at 2 fps (qwen-vl-utils' default for frame lists): all 8 -> 4 temporal patches; at 4 fps with
# max_frames 4: int(8/4*2) = 4 frames, linspace(0, 7, 4) rounded = 0, 2, 5, 7 -> 2 temporal patches.
assert [g[0] for g in grids] == [4, 2], grids
assert idx == list(range(8)) + [0, 2, 5, 7], idx
EOF

# train: two steps on the video dataset.
run $q train input/train_tiny.deck train.dataset=$tmp/ds train.steps=2 train.global_batch=3 train.micro_batch=1 data.seq_len=4096 checkpoint.every=0 run.out_dir=$tmp/out \
  run.timing=false && pass "train runs on videos" || true
[[ -s $tmp/out/metrics.jsonl ]] && holds 'x[0] > 0' "$($py -c "import json,sys; print(json.loads(open('$tmp/out/metrics.jsonl').readlines()[-1])['loss'])")" &&
  pass "a finite training loss" || bad "metrics: $(tail -1 $tmp/out/metrics.jsonl 2>/dev/null)"

# generate: answers to video prompts, the same in a batch of 3 and one by one (each prompt's visual spans stay its own).
gen() { $q generate model.preset=tiny generate.prompts=$tmp/d/video.jsonl generate.min_pixels=4096 \
          generate.max_new_tokens=5 run.timing=false "$@"; }
run gen generate.output=$tmp/a.jsonl &&
  run gen generate.output=$tmp/b.jsonl generate.batch=1
[[ $(wc -l <$tmp/a.jsonl) -eq 3 ]] && pass "3 answers" || bad "answers: $(cat $tmp/a.jsonl)"
$py - "$tmp/a.jsonl" <<'EOF' && pass "video prompts carry their pads" || bad "prompt sizes: $(cat $tmp/a.jsonl)"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
# Line 1: 4 temporal patches of the synth pictures' grid; line 2 adds an image and 2 patches; line 3 is text.
assert r[0]["prompt_tokens"] > r[2]["prompt_tokens"] + 4 * 5 and r[1]["prompt_tokens"] > r[2]["prompt_tokens"], r
EOF
cmp -s $tmp/a.jsonl $tmp/b.jsonl && pass "video prompts: batch 3 == one by one" ||
  bad "batching changes video answers: $(diff $tmp/a.jsonl $tmp/b.jsonl | head -4)"

# A real file (FFmpeg): 2 s at 10 fps -> int(20/10*2) = 4 frames, linspace(0, 19, 4) rounded = 0, 6, 13, 19; a
# truncated file fails naming the record and the file.
if needs "video files" ffmpeg; then
  ffmpeg -loglevel error -f lavfi -i testsrc=size=64x48:rate=10:duration=2 -pix_fmt yuv420p $tmp/d/clip.mp4 &&
    head -c 3000 $tmp/d/clip.mp4 >$tmp/d/cut.mp4
  printf '%s\n' '{"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "Colours?"}]}, {"role": "assistant", "content": "Many."}]}' >$tmp/d/file.jsonl
  run $q prepare prepare.input=$tmp/d/file.jsonl prepare.output=$tmp/fds &&
    $py -c "import h5py, glob, sys; h = h5py.File(glob.glob('$tmp/fds/shard-*.h5')[0]); \
sys.exit(not (h['frame_index'][()].tolist() == [0, 6, 13, 19] and h['video_grid'][()].tolist() == [[2, 4, 4]] \
and h['video_fps'][()].tolist() == [10.0]))" && pass "a video file: sampled frames 0 6 13 19, grid 2x4x4" ||
    bad "video file shard: $(tail -3 $tmp/log)"
  run gen generate.prompts=$tmp/d/file.jsonl generate.output=$tmp/f.jsonl && [[ $(wc -l <$tmp/f.jsonl) -eq 1 ]] &&
    pass "generate answers a video file" || bad "generate on a video file"
  printf '%s\n' '{"messages": [{"role": "user", "content": [{"type": "video", "video": "cut.mp4"}]}]}' >$tmp/d/cut.jsonl
  expect "a truncated video file is named" 1 "cut.jsonl:1: message 1 part 1: video 'cut.mp4'" \
    gen generate.prompts=$tmp/d/cut.jsonl generate.output=$tmp/x.jsonl
fi

# serve (issue 31): videos as OpenAI video_url parts through the official Node client, as data: URLs (mp4, webm) and
# as paths under serve.image_dir, alone, after an image and two in one prompt: generate's greedy answers and prompt
# sizes. The same clips again hit the prefix cache (/metrics), another clip of the same size (the same token ids)
# only before its frames. Bad videos get 4xx naming the part (and FFmpeg's reason), a clip longer than the context
# 413 with its token count, and the server answers on. The clips: 2 s of 64x48 at 10 fps (4 frames sampled).
serve_video() {
  local d=$tmp/sv port pid ref=$tmp/sv_gen.jsonl h0 h1 h2 h3 l n
  mkdir -p $d/images && cp $tmp/d/images/$(ls $tmp/d/images | head -1) $d/images/pic.png
  local ff="ffmpeg -loglevel error -y -f lavfi -i"
  $ff testsrc=size=64x48:rate=10:duration=2 -pix_fmt yuv420p $d/clip.mp4 &&
    $ff mandelbrot=size=64x48:rate=10 -t 2 -pix_fmt yuv420p $d/clip2.mp4 &&
    $ff testsrc2=size=64x48:rate=10:duration=2 -c:v libvpx-vp9 -pix_fmt yuv420p $d/clip.webm &&
    $ff testsrc=size=1280x1024:rate=10:duration=0.4 -pix_fmt yuv420p $d/big.mp4 &&
    $ff testsrc=size=64x48:rate=2:duration=120 -pix_fmt yuv420p $d/long.mp4 &&
    $ff sine=duration=1 -c:a aac $d/audio.m4a || { bad "serve video: ffmpeg could not make the clips"; return; }
  head -c 3000 $d/clip.mp4 >$d/cut.mp4
  yes "q3vl test: these bytes are no video" | head -c 20000 >$d/junk.mp4  # fixed bytes (random ones can probe as a format)
  printf 'YUV4MPEG2 W320 H240 F24:1 Ip A1:1 C420jpeg\n' >$d/empty.y4m
  { printf 'YUV4MPEG2 W100000 H100000 F24:1 Ip A1:1 C420jpeg\nFRAME\n'; head -c 1000 /dev/zero; } >$d/huge.y4m
  local q1='{"type": "text", "text": "What moves?"}' v1='{"type": "video", "video": "clip.mp4"}'
  printf '%s\n' \
    "{\"messages\": [{\"role\": \"user\", \"content\": [$v1, $q1]}]}" \
    "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image\", \"image\": \"images/pic.png\"}, {\"type\": \"video\", \"video\": \"clip.webm\"}, $q1]}]}" \
    "{\"messages\": [{\"role\": \"user\", \"content\": [$q1, $v1, {\"type\": \"video\", \"video\": \"clip2.mp4\"}]}]}" \
    >$d/prompts.jsonl
  gen generate.prompts=$d/prompts.jsonl generate.max_new_tokens=6 generate.output=$ref >$tmp/sv_gen.log 2>&1 ||
    { bad "serve video: generate failed: $(tail -3 $tmp/sv_gen.log)"; return; }
  $q serve model.preset=tiny serve.port=0 serve.min_pixels=4096 serve.image_dir=$d serve.max_context=512 \
    serve.max_image_pixels=1000000 serve.model_name=q3vl-tiny run.timing=false >$tmp/sv.log 2>&1 &
  pid=$!
  port=$(server_port $tmp/sv.log $pid) ||
    { bad "serve video: the server did not come up: $(tail -5 $tmp/sv.log)"; kill $pid; wait $pid; return; }
  metric() { curl -s -m 5 http://127.0.0.1:$port/metrics | grep -oP "^$1 \K[0-9]+"; }
  node_v() { node tests/cli/serve_client.mjs $port q3vl-tiny "$@"; }
  h0=$(metric q3vl_prefix_cache_hit_tokens_total)
  node_v answers $d/prompts.jsonl data >$tmp/sv_data.jsonl 2>$tmp/sv_err.log || bad "client: $(tail -3 $tmp/sv_err.log)"
  ref=$ref same_answers "serve: video_url data: URLs (mp4, webm; after an image; two clips) == generate" $tmp/sv_data.jsonl
  h1=$(metric q3vl_prefix_cache_hit_tokens_total)
  node_v answers $d/prompts.jsonl path >$tmp/sv_path.jsonl 2>$tmp/sv_err.log || bad "client: $(tail -3 $tmp/sv_err.log)"
  ref=$ref same_answers "serve: video_url paths under serve.image_dir == generate" $tmp/sv_path.jsonl
  h2=$(metric q3vl_prefix_cache_hit_tokens_total)
  # The second pass takes every full block of each prompt (but the last token's) from the cache: the same decoded
  # frames, whether sent as bytes or named by path. The first took less (prompt 3 starts with text, not the video).
  $py - "$tmp/sv_data.jsonl" "$h0" "$h1" "$h2" <<'PY' && pass "serve: the same videos again hit the prefix cache" ||
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
h0, h1, h2 = map(int, sys.argv[2:5])
want = sum((x["usage"]["prompt_tokens"] - 1) // 16 * 16 for x in r)
assert h1 - h0 < want, (h0, h1, want)
assert h2 - h1 == want > 0, (h1, h2, want)
PY
    bad "serve video prefix hits: $h0 $h1 $h2 $(cat $tmp/sv_data.jsonl)"
  # Another clip of the same size and length (the same token ids and positions as clip.mp4): no hit past its start.
  printf '%s\n' "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"video\", \"video\": \"clip2.mp4\"}, $q1]}]}" >$d/other.jsonl
  node_v answers $d/other.jsonl data >$tmp/sv_other.jsonl 2>$tmp/sv_err.log || bad "client: $(tail -3 $tmp/sv_err.log)"
  h3=$(metric q3vl_prefix_cache_hit_tokens_total)
  (( h3 - h2 < 16 )) && pass "serve: another clip with the same tokens does not hit past its first frame" ||
    bad "serve: another clip hit $((h3 - h2)) tokens"
  # Seeded sampling (temperature 1, generate's seed run.seed for its first prompt, so one generate per prompt): a random
  # model's greedy answers say little, its samples follow the logits. clip.mp4 and clip2.mp4 alone have the same
  # token ids: their samples differ only through the frames.
  cat $d/prompts.jsonl $d/other.jsonl >$d/seeded.jsonl
  for i in 1 2 3 4; do
    sed -n ${i}p $d/seeded.jsonl >$d/s$i.jsonl
    gen generate.prompts=$d/s$i.jsonl generate.max_new_tokens=6 generate.temperature=1 generate.output=$tmp/s$i.jsonl \
      >$tmp/sv_gen.log 2>&1 || bad "serve video: seeded generate $i failed: $(tail -3 $tmp/sv_gen.log)"
    sed "s/\"line\": *1,/\"line\":$i,/" $tmp/s$i.jsonl
  done >$tmp/sv_seed_gen.jsonl
  SEED=1234 node_v answers $d/seeded.jsonl data >$tmp/sv_seed.jsonl 2>$tmp/sv_err.log || bad "client: $(tail -3 $tmp/sv_err.log)"
  ref=$tmp/sv_seed_gen.jsonl same_answers "serve: video_url, seeded samples == generate's" $tmp/sv_seed.jsonl
  $py - "$tmp/sv_seed_gen.jsonl" <<'PY' && pass "seeded samples depend on the frames (clip.mp4 vs clip2.mp4)" ||
import json, sys
r = {x["line"]: x for x in map(json.loads, open(sys.argv[1]))}
assert sorted(r) == [1, 2, 3, 4], r
assert r[1]["prompt_tokens"] == r[4]["prompt_tokens"] and r[1]["answer"] != r[4]["answer"], (r[1], r[4])
PY
    bad "samples do not depend on the frames: $(cat $tmp/sv_seed_gen.jsonl)"
  node_v video-errors $d >$tmp/sv_errs.jsonl 2>$tmp/sv_err.log || bad "client video-errors: $(tail -3 $tmp/sv_err.log)"
  while read -r l; do
    n=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["name"], r["ok"])' "$l")
    [[ $n == *True ]] && pass "serve ${n% True}" || bad "serve ${n% False}: $l"
  done <$tmp/sv_errs.jsonl
  [[ $(wc -l <$tmp/sv_errs.jsonl) -eq 13 ]] || bad "serve video errors: $(wc -l <$tmp/sv_errs.jsonl) of 13 ran"
  curl -sf -m 5 http://127.0.0.1:$port/health >/dev/null && pass "serve: up after the bad videos" ||
    bad "serve down: $(tail -5 $tmp/sv.log)"
  kill -TERM $pid; wait $pid
  # Tensor parallel over 2 ranks: rank 0's video features go out with the step; the samples stay generate's.
  mpiexec -n 2 $q serve model.preset=tiny serve.port=0 serve.min_pixels=4096 serve.max_context=512 serve.kv_mib=8 \
    serve.model_name=q3vl-tiny run.timing=false >$tmp/sv_tp.log 2>&1 &
  pid=$!
  if port=$(server_port $tmp/sv_tp.log $pid); then
    SEED=1234 node_v answers $d/seeded.jsonl data >$tmp/sv_tp.jsonl 2>$tmp/sv_err.log || bad "client: $(tail -3 $tmp/sv_err.log)"
    ref=$tmp/sv_seed_gen.jsonl same_answers "serve, TP = 2: video_url, seeded samples == generate's" $tmp/sv_tp.jsonl
  else
    bad "serve video, TP = 2: the server did not come up: $(tail -5 $tmp/sv_tp.log)"
  fi
  kill -TERM $pid; wait $pid
}
if [[ -n $(node_client_missing) ]]; then skip "serve with videos (every check)" "$(node_client_missing)"
elif needs "serve with videos" ffmpeg; then serve_video; fi
# synth.kind = video: real clips (H.264 when libavcodec has libx264), records naming them, the answers' words, the
# same bytes for the same seed; a clip through prepare samples 4 of its 8 frames (1 s at 8 fps, video.fps 2).
if needs "synth video clips" ffprobe; then
  sv() { $q synth synth.kind=video synth.train_samples=12 synth.val_samples=0 synth.eval_samples=2 run.timing=false "$@"; }
  run sv synth.dir=$tmp/v1 && grep -q "12 train, 0 validation and 2 held-out clips of 8 frames of 64 px at 8 fps, encoded with libx264 (H.264)" $tmp/log &&
    pass "synth video: 14 clips, the log names the encoder" || bad "synth video log: $(grep synth: $tmp/log)"
  [[ $(ffprobe -v error -count_frames -select_streams v:0 -show_entries stream=codec_name,width,height,nb_read_frames,avg_frame_rate \
       -of csv=p=0 $tmp/v1/clips/eval_000001.mp4) == "h264,64,64,8/1,8" ]] && pass "a clip is H.264, 64x64, 8 frames at 8 fps" ||
    bad "clip: $(ffprobe -v error -count_frames -show_entries stream=codec_name,width,height,nb_read_frames,avg_frame_rate -of csv=p=0 $tmp/v1/clips/eval_000001.mp4 2>&1)"
  $py - "$tmp/v1" <<'EOF2' && pass "records: video parts naming the clips, answers 'a <colour> <circle|square> moving <way>'" || bad "synth video records: $(head -2 $tmp/v1/train.jsonl)"
import json, os, re, sys
d = sys.argv[1]
for split, n in (("train", 12), ("eval", 2)):
    recs = [json.loads(l) for l in open(f"{d}/{split}.jsonl")]
    assert len(recs) == n, (split, len(recs))
    for i, r in enumerate(recs):
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        assert user[0] == {"type": "video", "video": f"clips/{split}_{i:06d}.mp4"}, user
        assert os.path.getsize(f"{d}/{user[0]['video']}") > 100
        assert re.fullmatch(r"an? (red|green|blue|yellow|purple|orange) (circle|square) moving (left|right|up|down)", answer), answer
assert not os.path.exists(f"{d}/val.jsonl") and not os.path.exists(f"{d}/images")
EOF2
  # Bytes are compared on FFmpeg's own mpeg4 encoder, bit-exact by design (AV_CODEC_FLAG_BITEXACT); libx264's bytes
  # follow its SIMD paths (valgrind's CPU gives others), so with it the records are compared.
  run sv synth.dir=$tmp/v2 && cmp -s $tmp/v1/train.jsonl $tmp/v2/train.jsonl && cmp -s $tmp/v1/eval.jsonl $tmp/v2/eval.jsonl &&
    run sv synth.dir=$tmp/m1 synth.encoder=mpeg4 && run sv synth.dir=$tmp/m2 synth.encoder=mpeg4 &&
    run sv synth.dir=$tmp/m3 synth.encoder=mpeg4 synth.seed=2 &&
    diff -r $tmp/m1 $tmp/m2 >/dev/null && cmp -s $tmp/m1/clips/eval_000000.mp4 $tmp/m3/clips/eval_000000.mp4 &&
    ! cmp -s $tmp/m1/clips/train_000000.mp4 $tmp/m3/clips/train_000000.mp4 &&
    pass "synth video is deterministic: same seed, same files; another seed, other training clips" ||
    bad "synth video determinism: $(diff -rq $tmp/v1 $tmp/v2 | head -2) $(diff -rq $tmp/m1 $tmp/m2 | head -2)"
  run sv synth.dir=$tmp/v4 synth.encoder=mpeg4 synth.size=32 synth.frames=6 synth.fps=12 &&
    [[ $(ffprobe -v error -count_frames -select_streams v:0 -show_entries stream=codec_name,width,nb_read_frames,avg_frame_rate \
         -of csv=p=0 $tmp/v4/clips/train_000000.mp4) == "mpeg4,32,12/1,6" ]] && grep -q "encoded with mpeg4," $tmp/log &&
    pass "synth.encoder=mpeg4, size, frames and fps are the clips'" || bad "mpeg4 clips: $(tail -2 $tmp/log)"
  run $q prepare prepare.input=$tmp/v1/train.jsonl prepare.output=$tmp/vds &&
    grep -q "12 sample(s) .* 0 images, 12 videos" $tmp/log &&
    $py -c "import h5py, glob, sys; h = h5py.File(sorted(glob.glob('$tmp/vds/shard-*.h5'))[0]); \
sys.exit(not (h['frame_index'][:4].tolist() == [0, 2, 5, 7] and h['video_grid'][0].tolist() == [2, 4, 4]))" &&
    pass "prepare decodes the synth clips: frames 0 2 5 7, grid 2x4x4" || bad "prepare on synth clips: $(tail -3 $tmp/log)"
  expect "synth video: an odd size is named" 1 "synth.size: video frames need an even side of at least 32 pixels, got 33" \
    sv synth.dir=$tmp/v5 synth.size=33
  expect "synth video: an unknown encoder is named with the clip" 1 "clips/train_000000.mp4: cannot write video: this libavcodec has no video encoder 'nope'" \
    sv synth.dir=$tmp/v6 synth.encoder=nope
  [[ ! -e $tmp/v6/train.jsonl && -z $(ls $tmp/v6/clips) ]] && pass "a failed synth leaves no records or clips" ||
    bad "after a failed synth: $(ls -R $tmp/v6 | head)"
  # The same clips as lists of PNG frames (synth.encoder = frames, for a q3vl without FFmpeg): prepare samples the
  # same frames and writes the same tokens (the pixels differ by the H.264 coding only).
  run sv synth.dir=$tmp/v7 synth.encoder=frames && grep -q "clips of 8 frames of 64 px at 8 fps, as lists of PNG frames" $tmp/log &&
    run $q prepare prepare.input=$tmp/v7/train.jsonl prepare.output=$tmp/vds7 &&
    $py -c "import h5py, glob, sys; a, b = (h5py.File(sorted(glob.glob(f'$tmp/{d}/shard-*.h5'))[0]) for d in ('vds', 'vds7')); \
sys.exit(not all((a[k][()] == b[k][()]).all() for k in ('input_ids', 'labels', 'frame_index', 'video_grid', 'video_fps')))" &&
    pass "synth.encoder=frames: frame lists with the clip's fps; prepare gives the clips' tokens" ||
    bad "frame-list clips: $(tail -3 $tmp/log; head -c 300 $tmp/v7/train.jsonl)"
fi
# make demo-video: its recipe and its refusal without make demo's model.
grep -q -- "--min-accuracy 90 " <<<"$(make -n demo-video)" && grep -q "bin/q3vl synth input/demo_video.deck" <<<"$(make -n demo-video)" &&
  grep -q '^kind = "video"' input/demo_video.deck && pass "make demo-video synthesizes clips and scores against 90%" ||
  bad "make demo-video's recipe: $(make -n demo-video | grep -E 'synth|score')"
expect "make demo-video without make demo's model names make demo" 2 "no trained demo model: $tmp/none/checkpoints .*run make demo first" \
  env -u MAKEFLAGS -u MAKELEVEL make --no-print-directory -o bin/q3vl demo-video DEMO_OUT=$tmp/none DEMO_VIDEO_OUT=$tmp/dvo
[[ ! -e $tmp/dvo ]] && pass "nothing written without it" || bad "$tmp/dvo was created without a demo model"

# Bad video parts: named by file, line and part; nothing written.
printf '%s\n' '{"messages": [{"role": "user", "content": [{"type": "video", "video": ["images/nope.png", "images/nope2.png"]}]}]}' >$tmp/d/bad1.jsonl
expect "a missing frame is named" 1 "bad1.jsonl:1: message 1 part 1: video 'images/nope.png, ...' frame 1 'images/nope.png': no such file" \
  gen generate.prompts=$tmp/d/bad1.jsonl generate.output=$tmp/x.jsonl
printf '%s\n' '{"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4", "frames": 8}]}]}' >$tmp/d/bad2.jsonl
expect "an unknown video key is named" 1 "bad2.jsonl:1: message 1 part 1: unknown key \"frames\" in a video part" \
  gen generate.prompts=$tmp/d/bad2.jsonl generate.output=$tmp/x.jsonl
[[ ! -e $tmp/x.jsonl ]] && pass "nothing written for bad prompts" || bad "an output was written"
expect "prepare names a bad video setting" 1 "bad3.jsonl:1: message 1 part 1: \"max_frames\" must be a whole number" \
  bash -c "printf '%s\n' '{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"video\", \"video\": \"c.mp4\", \"max_frames\": -2}]}, {\"role\": \"assistant\", \"content\": \"x\"}]}' >$tmp/d/bad3.jsonl && $q prepare prepare.input=$tmp/d/bad3.jsonl prepare.output=$tmp/ds3"
finish
