#!/usr/bin/env bash
# call E (thirty-fifth session, the device time left): one 30B-A3B bf16 stream served with the MoE link
# (Q3VL_CHAIN_MOE=1) and without, each server started here (as serve_checks.sh's `big`) so that its log, the GPU's
# utilization every 2 s and the bench row come back whatever happens: a server not up in 150 s is reported with its
# log's tail and ended.
source tools/gpu/call_lib.sh callE
pkill -9 -f 'rt/bin/q3vl'; sleep 2
"$q" synth synth.dir=/tmp/de synth.train_samples=1 synth.eval_samples=1 synth.seed=3 run.timing=false >/dev/null 2>&1
png=$(ls /tmp/de/images/*.png | head -1)
one() {
  local name=$1 t0=$SECONDS port="" pid smi; shift
  (while sleep 2; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> "$out/smi_$name.txt"; done) &
  smi=$!
  env "$@" "$q" serve model.preset=30B-A3B model.backend=cuda model.dtype=bf16 serve.port=0 serve.max_context=8192 \
    serve.max_batch=64 serve.step_tokens=2048 run.timing=false > "$out/serve_$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 750); do
    port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' "$out/serve_$name.log")
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  say "$name ($*): up after $((SECONDS - t0)) s (port '$port')"; pack
  if [[ -n $port ]]; then
    env -u LD_LIBRARY_PATH timeout 90 python3 tools/bench_serve --port "$port" -n 8 -c 1 --prompt-words 200 \
      --image "$png" --max-tokens 128 --label "$name bf16 c=1" --timeout 80 >> "$out/bench_$name.txt" 2>&1
    say "$name: bench rc=$? $(grep -E ' c=1 ' "$out/bench_$name.txt" | tail -1)"
    kill -TERM $pid; sleep 3
    say "$name: $(grep -oE 'decode-only steps [^;]*' "$out/serve_$name.log" | tail -1)"
  else
    say "$name: log tail: $(tail -4 "$out/serve_$name.log" | tr '\n' ' ')"
  fi
  kill -9 $pid 2>/dev/null; kill $smi; pkill -9 -f 'rt/bin/q3vl'; sleep 2
  say "$name: GPU memory.used, utilization (last 5 samples): $(tail -5 "$out/smi_$name.txt" | tr '\n' ' ')"; pack
}
one q30b_moe Q3VL_CHAIN_MOE=1
one q30b Q3VL_CHAIN_MOE=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
