# Shared setup and steps of one device call (sourced by the call scripts kept beside their results in docs/perf/):
#   source tools/gpu/call_lib.sh OUTNAME       # unpacks devpack/rt.tar.xz (pack-runtime's) and devpack/tok.tar.xz
#   unit_gpu FILTER TIMEOUT [NAME]             # the GPU suites (Q3VL_REQUIRE_GPU=1) into NAME.log (unit.log): a
#                                              # line and the failures (gtest's and the op table's rows); its rc
#   train_prof NAME DECK TIMEOUT [ARGS...]     # q3vl train with run.profile_shapes at run.profile_step (default 3)
#   hf_train NAME TIMEOUT [ARGS...]            # tools/gpu/hf_train_baseline.py, metrics in NAME.jsonl
#   ratio Q HF LABEL                           # median tokens/s (and MFU) of steps 3.. of two metrics files, the ratio
#   vs_hf 2b|30b                               # issue 30's shapes: q3vl profiled, transformers, the ratio
#   prof_rows NAME...                          # train_prof runs' step time and a few rows (AdamW, norms, experts)
#   left SECONDS                               # whether the call (560 s of its 600) still has SECONDS left
#   chain_ab MODES TIMEOUT                     # tools/gpu/chain_bench's modes (16 layers, 30 replays) into
#                                              # chain_bench.txt, its table rows into the summary
#   serve_one NAME PART TIMEOUT [ENV=V...]     # one serve_checks.sh part at one stream (CONC=4 among the ENV=V: 4
#                                              # streams): its bench row and decode steps
#   serve_own NAME PRESET "KEYS" [ENV=V...]    # a server of PRESET (bf16, KEYS more deck keys) started here, 150 s
#                                              # to come up, 8 requests at one stream: its log, bench row and the
#                                              # GPU's memory and utilization come back whatever happens
# The pack (on the build machine): make FFMPEG=0 NVFLAGS_EXTRA=--no-compress bin/q3vl bin/unit_tests ... (FFmpeg's
# libraries and theirs would make it 71 MB, over a call's 64 MiB; uncompressed fatbins let xz share the device code),
# strip the binaries, ../shared/device/pack-runtime devpack BINARIES, then repack its rt/ with
# XZ_OPT='--lzma2=preset=9e,dict=512MiB' (about 32 MB for q3vl, unit_tests, mpi_tests and moe_bench).
# Results gather in /tmp/OUTNAME and go to $OUT/results.tgz after every step (a call cut short returns what finished).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
[[ -f devpack/tok.tar.xz ]] && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/$1 final=$OUT
rm -rf "$out" /tmp/runs /tmp/results; mkdir -p "$out"  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp "$out/summary.txt" "$final/" 2>/dev/null; }
say() { echo "$*" >> "$out/summary.txt"; }
nvidia-smi -L > "$out/summary.txt"
unit_gpu() {
  local t1=$SECONDS n=${3:-unit} rc
  Q3VL_REQUIRE_GPU=1 timeout "$2" /tmp/rt/bin/unit_tests --gtest_filter="$1" > "$out/$n.log" 2>&1; rc=$?
  say "$n rc=$rc $((SECONDS - t1)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/$n.log" | tr '\n' ' ')"
  grep -E "FAIL" "$out/$n.log" | head -20 >> "$out/summary.txt"; pack
  return $rc
}
train_prof() {  # the run's final checkpoint is not waited for: the timeout ends it
  local n=$1 deck=$2 t=$3 t1=$SECONDS; shift 3
  timeout "$t" "$q" train "$deck" checkpoint.every=0 run.profile=true run.profile_step=3 run.profile_shapes=true \
    run.out_dir=/tmp/runs/$n "$@" > "$out/$n.log" 2>&1
  say "$n rc=$? $((SECONDS - t1)) s"
  cp /tmp/runs/$n/metrics.jsonl "$out/$n.jsonl" 2>/dev/null; rm -rf /tmp/runs/$n
  sed -n '/^profile of step/,/compute stream busy/p' "$out/$n.log" > "$out/${n}_profile.txt"; pack
}
hf_train() {
  local n=$1 t=$2 t1=$SECONDS; shift 2
  env -u LD_LIBRARY_PATH timeout "$t" python3 tools/gpu/hf_train_baseline.py --out "$out/$n.jsonl" "$@" > "$out/$n.log" 2>&1
  say "$n rc=$? $((SECONDS - t1)) s: $(tail -1 "$out/$n.log")"; pack
}
ratio() {
  env -u LD_LIBRARY_PATH python3 - "$out/$1.jsonl" "$out/$2.jsonl" "$3" >> "$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
q, h = ([json.loads(l) for l in open(f) if "tokens_per_s" in l][2:] for f in sys.argv[1:3])
tq, th = (statistics.median(x["tokens_per_s"] for x in r) for r in (q, h))
mq, mh = (statistics.median(x.get("mfu", 0) for x in r) for r in (q, h))
print(f"{sys.argv[3]}, steps 3-{len(q) + 2}: q3vl {tq:.0f} tokens/s (mfu {mq:.3f}), transformers {th:.0f} (mfu {mh:.3f}): "
      f"{tq / th:.2f}x")
PY
  pack
}
prof_rows() {
  local n
  for n in "$@"; do
    say "$n: $(grep -E '^ +(adamw|sum_squares|grouped_linear_bwd|layernorm_bwd)' "$out/${n}_profile.txt" |
      tr -s ' ' | cut -d' ' -f2-6 | tr '\n' ';')"
    say "$n: $(head -1 "$out/${n}_profile.txt"); $(grep -m1 'gradient norm:' "$out/$n.log")"
  done
}
vs_hf() {  # the three steps every call script ran for these two shapes
  case $1 in
    2b) train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
        hf_train hf2b 200
        ratio q2b hf2b "2B, 4 x 4096 tokens a step" ;;
    30b) train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
         hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
         ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens" ;;
    *) say "vs_hf: 2b or 30b, not '$1'"; return 1 ;;
  esac
}
left() { (( 560 - (SECONDS - T0) > $1 )); }
chain_ab() {
  local t1=$SECONDS
  timeout "$2" /tmp/rt/bin/chain_bench 16 30 "$1" > "$out/chain_bench.txt" 2>&1
  say "chain_bench rc=$? $((SECONDS - t1)) s"; grep -E '^\| (chain|attn|none)' "$out/chain_bench.txt" >> "$out/summary.txt"; pack
}
serve_one() {
  local n=$1 p=$2 t=$3 t1=$SECONDS; shift 3
  rm -rf /tmp/results
  env CONC=1 "$@" timeout "$t" bash tools/gpu/serve_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/sc_$n "$p" > /dev/null 2>&1
  mkdir -p "$out/$n"; tar xzf /tmp/sc_$n/results.tgz -C "$out/$n" 2>/dev/null
  say "$n ($*) $((SECONDS - t1)) s: $(grep -hE ' c=[0-9]+ ' "$out/$n/summary.txt" | head -2 | tr '\n' ' ')"
  say "$n: $(grep -ho 'decode-only steps [^;]*' "$out/$n/summary.txt")"
  grep -h 'answers equal' "$out/$n/summary.txt" | cut -d';' -f1 >> "$out/summary.txt"; pack
}
serve_own() {
  local name=$1 preset=$2 keys=$3 t0=$SECONDS port="" pid smi png; shift 3
  pkill -9 -f 'rt/bin/q3vl serve'; sleep 1
  [[ -d /tmp/own ]] || "$q" synth synth.dir=/tmp/own synth.train_samples=1 synth.eval_samples=1 synth.seed=3 \
    run.timing=false >/dev/null 2>&1
  png=$(ls /tmp/own/images/*.png | head -1)
  (while sleep 2; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> "$out/smi_$name.txt"; done) &
  smi=$!
  # shellcheck disable=SC2086  # KEYS: words
  env "$@" "$q" serve model.preset=$preset model.backend=cuda model.dtype=bf16 serve.port=0 serve.max_context=8192 \
    serve.max_batch=64 serve.step_tokens=2048 run.timing=false $keys > "$out/serve_$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 750); do
    port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' "$out/serve_$name.log")
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  say "$name ($preset $keys $*): up after $((SECONDS - t0)) s"; pack
  if [[ -n $port ]]; then
    env -u LD_LIBRARY_PATH timeout 90 python3 tools/bench_serve --port "$port" -n 8 -c 1 --prompt-words 200 \
      --image "$png" --max-tokens 128 --label "$name c=1" --timeout 80 >> "$out/bench_$name.txt" 2>&1
    say "$name: bench rc=$? $(grep -E ' c=1 ' "$out/bench_$name.txt" | tail -1)"
  else
    say "$name: not up; log tail: $(tail -4 "$out/serve_$name.log" | tr '\n' ' ')"
  fi
  kill -9 $pid 2>/dev/null; kill $smi; pkill -9 -f 'rt/bin/q3vl serve'; sleep 2
  say "$name: GPU memory.used, utilization (last 4 samples): $(tail -4 "$out/smi_$name.txt" | tr '\n' ' ')"; pack
}
