#!/usr/bin/env bash
# `q3vl serve` through the official OpenAI Node client (tests/cli/serve_client.mjs) on a random tiny model: chat
# with images as data URLs and as paths under serve.image_dir, streaming and not, greedy answers equal to
# `q3vl generate`'s, bad requests answered with OpenAI error objects while the server stays up, 32 concurrent
# streams with some clients leaving mid-answer, a KV cache too small for two requests queueing them, /metrics,
# SIGTERM, and tensor parallelism over 2 and 4 ranks. Prefix sharing (on by default): requests that share prompt
# starts answer as with serve.prefix_cache=false while prefilling fewer tokens, on 1 and 2 ranks; cached blocks are
# evicted for new requests; a non-streaming client that leaves cancels its request; tools/bench_serve's table.
source "$(dirname "$0")/../lib.sh"
q=${Q3VL:-bin/q3vl}
client=tests/cli/serve_client.mjs
why=$(node_client_missing)
[[ -z $why ]] || { skip "test_serve (every check: each needs the client)" "$why"; finish; }

$q synth synth.dir=$tmp/d synth.train_samples=1 synth.eval_samples=6 synth.seed=3 run.timing=false >/dev/null 2>&1 ||
  { bad "synth failed"; finish; }
# The reference: generate's greedy answers for the held-out prompts.
$q generate model.preset=tiny generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 generate.max_new_tokens=6 \
  generate.output=$tmp/gen.jsonl run.timing=false >$tmp/gen.log 2>&1 || bad "generate failed: $(tail -3 $tmp/gen.log)"

pids=()
# start NAME ARGS...: a server on a free port in the background; sets $port (empty when it did not come up).
start() {
  local name=$1; shift
  "$@" serve.port=0 serve.min_pixels=4096 serve.image_dir=$tmp/d run.timing=false >$tmp/$name.log 2>&1 &
  pids+=($!)
  port=$(server_port $tmp/$name.log ${pids[-1]}) && return 0
  bad "$name: the server did not come up: $(tail -5 $tmp/$name.log)"
  return 1
}
stop_all() { for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null; done; wait 2>/dev/null; }
trap 'stop_all; rm -rf "$tmp"' EXIT
health() { curl -sf -m 5 http://127.0.0.1:$port/health >/dev/null; }
node_c() { node $client $port q3vl-tiny "$@"; }

# check_prefix ON OFF: the prefix command's answers with the prefix cache (ON) equal those without (OFF); the hits
# are whole 16-token blocks where the prompts share them, and prefill computes only the rest.
check_prefix() {
  $py - "$1" "$2" <<'EOF' && pass "prefix cache: same greedy answers, hits where prompts share blocks, less prefill" || bad "prefix cache: $(cat $1)"
import json, sys
on, off = ({r["name"]: r for r in map(json.loads, open(f))} for f in sys.argv[1:3])
B = 16
assert on.keys() == off.keys() and len(on) == 6, (on.keys(), off.keys())
for n, r in on.items():
    assert (r["answer"], r["sample"], r["prompt_tokens"]) == (off[n]["answer"], off[n]["sample"], off[n]["prompt_tokens"]), (r, off[n])
    assert off[n]["hit"] == 0 and off[n]["prefill"] == r["prompt_tokens"], off[n]
    assert r["hit"] % B == 0 and r["prefill"] == r["prompt_tokens"] - r["hit"], r
assert on["image"]["hit"] == 0 and on["system-a"]["hit"] == 0, on
assert on["image-again"]["hit"] == (on["image-again"]["prompt_tokens"] - 1) // B * B > 0, on["image-again"]
assert on["other-image"]["hit"] < on["image-again"]["hit"], on["other-image"]       # other pixels, same ids
assert 0 < on["system-b"]["hit"] <= on["system-b"]["prompt_tokens"] - B, on["system-b"]  # the system prompt only
assert on["second-turn"]["hit"] >= on["system-a"]["prompt_tokens"] // B * B, on["second-turn"]
assert sum(r["prefill"] for r in on.values()) < sum(r["prefill"] for r in off.values())
assert len({r["sample"] for r in on.values()}) > 1, "the samples do not depend on the prompt"
EOF
}
if start nopfx $q serve model.preset=tiny serve.kv_mib=8 serve.prefix_cache=false; then
  node_c prefix $tmp/d >$tmp/pfx_off.jsonl 2>$tmp/err.log || bad "client prefix: $(tail -3 $tmp/err.log)"
  kill -TERM ${pids[-1]}; wait ${pids[-1]}
fi
if start main $q serve model.preset=tiny serve.max_batch=40; then
  # serve.kv_mib = 0 (default): what 40 sequences of 4096 tokens (+ a block) can fill at 512 B a token (tiny: 2
  # layers x keys and values x 2 kv heads x 16 x fp32), 80.3 MiB (any machine that runs these tests has 161 MiB free).
  grep -q "KV cache 10280 blocks of 16 tokens (80.31 MiB, 164480 tokens; auto: what serve.max_batch x serve.max_context" \
    $tmp/main.log && pass "KV cache sized from max_batch x max_context" || bad "auto KV: $(grep 'KV cache' $tmp/main.log)"
  # Clients connecting at once must not overflow the listen queue (cpp-httplib's own backlog is 5): ss's Send-Q of a
  # listening socket is its backlog.
  bl=$(ss -ltnH "sport = :$port" 2>/dev/null | awk '{print $3}' | head -1)
  if [[ -z $bl ]]; then skip "listen backlog" "ss (iproute2, make deps) is not installed"
  elif ((bl >= 128)); then pass "listen backlog $bl"
  else bad "listen backlog $bl: cpp-httplib's 5 was not widened"; fi
  node_c prefix $tmp/d >$tmp/pfx_on.jsonl 2>$tmp/err.log || bad "client prefix: $(tail -3 $tmp/err.log)"
  check_prefix $tmp/pfx_on.jsonl $tmp/pfx_off.jsonl
  node_c answers $tmp/d/eval.jsonl data >$tmp/a_data.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  same_answers "chat with data: URL images == generate (greedy, usage)" $tmp/a_data.jsonl
  node_c answers $tmp/d/eval.jsonl stream >$tmp/a_stream.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  same_answers "streamed chat == generate" $tmp/a_stream.jsonl
  node_c answers $tmp/d/eval.jsonl path >$tmp/a_path.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  same_answers "images by path under serve.image_dir == generate" $tmp/a_path.jsonl

  node_c errors $tmp/d/images/eval_000000.png >$tmp/errs.jsonl 2>$tmp/err.log || bad "client errors: $(tail -3 $tmp/err.log)"
  while read -r l; do
    n=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["name"], r["ok"])' "$l")
    [[ $n == *True ]] && pass "${n% True}" || bad "${n% False}: $l"
  done <$tmp/errs.jsonl
  [[ $(wc -l <$tmp/errs.jsonl) -ge 14 ]] || bad "error cases: only $(wc -l <$tmp/errs.jsonl) ran"
  o=$(curl -s -m 5 -w ' %{http_code}' -d '{"messages": [' http://127.0.0.1:$port/v1/chat/completions)
  [[ $o == *'"invalid_request_error"'*' 400' ]] && pass "malformed JSON: 400 error object" || bad "malformed JSON: $o"
  o=$($py -c 'import json; print(json.dumps({"prompt": "hello " * 5000}))' |
        curl -s -m 20 -w ' %{http_code}' -H 'Content-Type: application/json' --data-binary @- \
          http://127.0.0.1:$port/v1/completions)
  [[ $o == *"this server's context is 4096 tokens"*' 413' ]] && pass "completions: prompt longer than the context: 413" ||
    bad "long prompt: ${o: -300}"

  # 32 streams at once, every 4th client leaving after its first chunk: the others get complete greedy answers.
  node_c parallel $tmp/d/eval.jsonl 32 4 >$tmp/par.jsonl 2>$tmp/err.log || bad "client parallel: $(tail -3 $tmp/err.log)"
  [[ $(grep -c '"line"' $tmp/par.jsonl) -eq 24 && $(grep -c '"aborted":8' $tmp/par.jsonl) -eq 1 ]] &&
    pass "32 streams: 24 answers, 8 clients left" || bad "32 streams: $(grep -c '"line"' $tmp/par.jsonl) answers: $(tail -3 $tmp/par.jsonl)"
  same_answers "32 concurrent streams == generate" $tmp/par.jsonl
  sleep 0.5
  m=$(curl -s -m 5 http://127.0.0.1:$port/metrics)
  grep -qE '^q3vl_kv_blocks_used 0$' <<<"$m" && grep -qE '^q3vl_batch_size 0$' <<<"$m" &&
    pass "left clients' sequences freed (metrics: 0 KV blocks, batch 0)" || bad "metrics after the streams: $m"
  for k in q3vl_requests_total q3vl_generation_tokens_total q3vl_queue_length q3vl_time_to_first_token_seconds_count \
           q3vl_time_per_output_token_seconds_sum; do
    grep -qE "^$k [0-9.e+]+$" <<<"$m" || bad "metrics: no $k"
  done
  # tools/bench_serve: its table's counts are the server's (requests, output tokens), the shared system prompt hits.
  g0=$(curl -s -m 5 http://127.0.0.1:$port/metrics | grep -oP '^q3vl_generation_tokens_total \K[0-9]+')
  tools/bench_serve --port $port -n 8 -c 4 --prompt-words 6 --system-words 24 --max-tokens 5 --label t >$tmp/bench.md 2>$tmp/err.log ||
    bad "bench_serve: $(tail -3 $tmp/err.log)"
  g1=$(curl -s -m 5 http://127.0.0.1:$port/metrics | grep -oP '^q3vl_generation_tokens_total \K[0-9]+')
  $py - $tmp/bench.md $((g1 - g0)) <<'EOF' && pass "bench_serve: one table, counts match the server's" || bad "bench_serve: $(cat $tmp/bench.md)"
import sys
rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in open(sys.argv[1]) if l.startswith("|")]
assert len(rows) == 3 and set(rows[1]) == {"---"}, rows
r = dict(zip(rows[0], rows[2]))
assert (r["run"], r["requests"], r["concurrency"], r["errors"]) == ("t", "8", "4", "0"), r
assert int(r["output tok"]) == int(sys.argv[2]) > 0, (r, sys.argv[2])
assert float(r["req/s"]) > 0 and float(r["output tok/s"]) > 0 and float(r["prefix hits %"]) > 0, r
assert 0 < float(r["TTFT p50 ms"]) <= float(r["TTFT p99 ms"]) and float(r["TPOT mean ms"]) > 0, r
EOF
  # A non-streaming client that leaves: its request stops decoding and gives its blocks back.
  c0=$(curl -s -m 5 http://127.0.0.1:$port/metrics | grep -oP '^q3vl_requests_cancelled_total \K[0-9]+')
  node_c abort 400 >$tmp/abort.jsonl 2>$tmp/err.log || bad "client abort: $(tail -3 $tmp/err.log)"
  sleep 0.5
  m=$(curl -s -m 5 http://127.0.0.1:$port/metrics)
  grep -q '"aborted":true' $tmp/abort.jsonl && grep -qE "^q3vl_requests_cancelled_total $((c0 + 1))$" <<<"$m" &&
    grep -qE '^q3vl_kv_blocks_used 0$' <<<"$m" && grep -qE '^q3vl_batch_size 0$' <<<"$m" &&
    grep -qE 'serve: a request cancelled \(its client left\) after [0-9]+ tokens; its 188 KV blocks released' $tmp/main.log &&
    pass "non-streaming client left: request cancelled, its 188 blocks back" ||
    bad "non-streaming abort: $(cat $tmp/abort.jsonl) $(grep -E 'cancelled|kv_blocks_used|batch_size' <<<"$m") $(tail -2 $tmp/main.log)"
  node_c answers $tmp/d/eval.jsonl data >$tmp/a_after.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  same_answers "answers after the cancelled request == generate" $tmp/a_after.jsonl
  health && pass "server up after errors and disconnects" || bad "server down: $(tail -5 $tmp/main.log)"
  kill -TERM ${pids[-1]}; wait ${pids[-1]}; rc=$?
  [[ $rc -eq 0 ]] && grep -q 'serve: stopping' $tmp/main.log && pass "SIGTERM: clean exit" || bad "SIGTERM: rc $rc $(tail -3 $tmp/main.log)"
fi

# serve.timeout: one sequence at a time and twelve long requests at once, 1 s each: the first runs its second and
# ends with what it has ("length"), the next may start and be cut too, those still queued past their second get 503
# with an error object; every one is counted and the server goes on. The twelve leave one process through a barrier:
# sent by twelve curl processes on a loaded 2-core machine they arrived over seconds, each was admitted just before
# its deadline, and none waited out its second in the queue.
if start timeout $q serve model.preset=tiny serve.max_batch=1 serve.timeout=1 serve.model_name=q3vl-tiny; then
  $py - $port <<'EOF2' >$tmp/to.log 2>&1 && health &&
import json, re, sys, threading, urllib.error, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
N, go, got = 12, threading.Barrier(12), [None] * 12
def ask(i):
    q = urllib.request.Request(url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 3000}).encode(),
                               {"Content-Type": "application/json"})
    go.wait()
    try:
        with urllib.request.urlopen(q, timeout=60) as r: got[i] = (r.status, json.load(r))
    except urllib.error.HTTPError as e: got[i] = (e.code, json.load(e))
ts = [threading.Thread(target=ask, args=(i,)) for i in range(N)]
for t in ts: t.start()
for t in ts: t.join()
m = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
counted = int(re.search(r"^q3vl_requests_timed_out_total (\d+)", m, re.M).group(1))
cut = busy = 0
for code, r in got:
    if code == 503:
        assert "serve.timeout" in r["error"]["message"] and r["error"]["type"] == "server_error", r
        busy += 1
    else:
        assert code == 200, (code, r)
        if r["choices"][0]["finish_reason"] == "length":
            assert 0 <= r["usage"]["completion_tokens"] < 3000, r["usage"]
            cut += 1
assert cut >= 1 and busy >= 1 and counted == cut + busy, (cut, busy, counted, [c for c, _ in got])
EOF2
    pass "serve.timeout: running requests cut short (length), queued ones 503, all counted, server up" ||
    bad "timeout: $(tail -c 600 $tmp/to.log)"
  kill -TERM ${pids[-1]}; wait ${pids[-1]}
fi

# A cache of 6 blocks of 8 tokens fits one request of serve.max_context = 40 (prompt ~20 tokens + 6: 4 blocks) at a
# time: the rest wait, none fails, and the blocks finished requests leave in the prefix cache are evicted for them.
if start small $q serve model.preset=tiny serve.kv_block=8 serve.kv_mib=0.024 serve.max_context=40; then
  grep -q 'KV cache 6 blocks of 8 tokens' $tmp/small.log || bad "small cache: $(grep 'KV cache' $tmp/small.log)"
  node_c parallel $tmp/d/eval.jsonl 6 0 >$tmp/q.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  [[ $(grep -c '"line"' $tmp/q.jsonl) -eq 6 ]] && pass "full KV cache: requests queue" || bad "queue: $(cat $tmp/q.jsonl)"
  same_answers "queued answers == generate" $tmp/q.jsonl
  m=$(curl -s -m 5 http://127.0.0.1:$port/metrics)
  grep -qE '^q3vl_prefix_cache_evicted_blocks_total [1-9][0-9]*$' <<<"$m" && grep -qE '^q3vl_prefix_cache_blocks [1-6]$' <<<"$m" &&
    pass "full cache of evictable prefix blocks: evicted, nobody failed" || bad "eviction: $(grep prefix <<<"$m")"
  o=$(curl -s -m 5 -w ' %{http_code}' -d "{\"prompt\": \"$(printf 'hi %.0s' {1..60})\", \"max_tokens\": 4}" \
    http://127.0.0.1:$port/v1/completions)
  [[ $o == *"this server's context is 40 tokens"*' 413' ]] && pass "a prompt longer than serve.max_context: 413" ||
    bad "too long: $o"
fi

# serve.max_tpot_ms far below what a step takes: once the server has measured a decode-only step and a mixed one,
# every step carries the floor of 32 prompt tokens (the metric says so), prompts take more steps, and 32 concurrent
# streams still get generate's greedy answers.
if start tpot $q serve model.preset=tiny serve.max_batch=40 serve.step_tokens=256 serve.max_tpot_ms=0.001; then
  node_c parallel $tmp/d/eval.jsonl 32 0 >$tmp/tpot.jsonl 2>$tmp/err.log || bad "client tpot: $(tail -3 $tmp/err.log)"
  same_answers "serve.max_tpot_ms: 32 streams == generate" $tmp/tpot.jsonl
  m=$(curl -s -m 5 http://127.0.0.1:$port/metrics)
  grep -qE '^q3vl_step_prompt_budget 32$' <<<"$m" && pass "serve.max_tpot_ms: steps carry the floor of 32 prompt tokens" ||
    bad "serve.max_tpot_ms: $(grep step_prompt_budget <<<"$m")"
  grep -qE 'serve.max_tpot_ms = 0.001 is below a decode-only step of [0-9]+ sequences here .*floor of 32 prompt tokens' \
    $tmp/tpot.log && pass "serve.max_tpot_ms below a decode-only step: said once" ||
    bad "serve.max_tpot_ms: no warning: $(grep -i tpot $tmp/tpot.log)"
  # The engine's time breakdown: every step is a decode-only or a mixed one, each picture went through the vision
  # tower at most once (a repeated one may come from the prefix cache), and the steps and encodes fit in the busy time.
  python3 -c '
import re, sys
m = {k: float(v) for k, v in re.findall(r"^(q3vl_engine_\w+) (\S+)$", sys.stdin.read(), re.M)}
g = lambda k: m["q3vl_engine_" + k]
ok = (g("decode_steps_total") > 0 and g("mixed_steps_total") > 0
      and g("decode_steps_total") + g("mixed_steps_total") == g("steps_total")
      and 1 <= g("vision_encodes_total") <= 32 and g("decode_step_rows_total") >= g("decode_steps_total")
      and 0 < g("decode_step_seconds_total") + g("mixed_step_seconds_total") + g("vision_seconds_total") <= g("busy_seconds_total"))
sys.exit(0 if ok else 1)' <<<"$m" && pass "/metrics: the engine's steps, encodes and busy time add up" ||
    bad "engine metrics: $(grep q3vl_engine <<<"$m")"
  kill -TERM ${pids[-1]}; wait ${pids[-1]}
fi

# Tensor parallel over 2 and 4 ranks (heads, MLP rows and vocabulary split; with 4, each kv head on 2 ranks): rank 0
# serves, all ranks compute, the greedy answers stay generate's.
for n in 2 4; do
  if start tp$n mpiexec -n $n $q serve model.preset=tiny serve.kv_mib=8; then
    grep -q "tensor parallel over $n ranks" $tmp/tp$n.log || bad "tp$n: $(grep serve: $tmp/tp$n.log)"
    node_c answers $tmp/d/eval.jsonl stream >$tmp/a_tp$n.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
    same_answers "TP = $n: streamed answers == generate" $tmp/a_tp$n.jsonl
    if [[ $n == 2 ]]; then  # rank 0 decides what is shared, rank 1 follows: the same answers, hits and prefill
      node_c prefix $tmp/d >$tmp/pfx_tp2.jsonl 2>$tmp/err.log || bad "client prefix: $(tail -3 $tmp/err.log)"
      cmp -s $tmp/pfx_tp2.jsonl $tmp/pfx_on.jsonl && pass "TP = 2: prefix-cache answers and hits == TP = 1" ||
        bad "TP = 2 prefix: $(diff $tmp/pfx_tp2.jsonl $tmp/pfx_on.jsonl | head -5)"
    fi
    kill -TERM ${pids[-1]}; wait ${pids[-1]}; rc=$?
    [[ $rc -eq 0 ]] && pass "TP = $n: SIGTERM ends every rank" || bad "tp$n: exit $rc $(tail -3 $tmp/tp$n.log)"
  fi
done
# A MoE model over 2 ranks: every expert's rows split, the router whole on each rank; answers equal generate's.
$q generate model.preset=tiny-moe generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 \
  generate.max_new_tokens=6 generate.output=$tmp/gen_moe.jsonl run.timing=false >$tmp/gen_moe.log 2>&1 ||
  bad "generate tiny-moe failed: $(tail -3 $tmp/gen_moe.log)"
if start moe_tp2 mpiexec -n 2 $q serve model.preset=tiny-moe serve.kv_mib=8 serve.model_name=q3vl-tiny; then
  node_c answers $tmp/d/eval.jsonl >$tmp/a_moe.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  ref=$tmp/gen_moe.jsonl same_answers "MoE, TP = 2: answers == generate" $tmp/a_moe.jsonl
fi
# The same with whole experts per rank (serve.ep = 2: each rank runs the rows routed to its 2 of the 4 experts).
if start moe_ep2 mpiexec -n 2 $q serve model.preset=tiny-moe serve.kv_mib=8 serve.model_name=q3vl-tiny serve.ep=2; then
  node_c answers $tmp/d/eval.jsonl >$tmp/a_moe_ep.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
  ref=$tmp/gen_moe.jsonl same_answers "MoE, TP = 2, serve.ep = 2: answers == generate" $tmp/a_moe_ep.jsonl
fi
# One model: DevModel::step over a paged KV cache, on the CPU op layer above; on the GPU where one is visible
# (model.backend = "cuda"), fp32: generate's answers.
grep -q "serve: on the CPU op layer, fp32: weights" $tmp/tp2.log &&
  grep -q "tensor-parallel sums over MPI in fp32 through the host" $tmp/tp2.log &&
  pass "TP = 2 on the CPU op layer: sums over MPI" || bad "tp2: $(grep 'serve: on' $tmp/tp2.log)"
if nvidia-smi -L >/dev/null 2>&1; then
  for n in 1 2; do
    if start dev$n mpiexec -n $n $q serve model.preset=tiny model.backend=cuda serve.kv_mib=8; then
      grep -q "serve: on GPU .*fp32: weights" $tmp/dev$n.log || bad "dev$n: $(grep serve: $tmp/dev$n.log)"
      node_c answers $tmp/d/eval.jsonl stream >$tmp/a_dev$n.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
      same_answers "CUDA, $n rank(s): streamed answers == generate on the CPU" $tmp/a_dev$n.jsonl
      kill -TERM ${pids[-1]}; wait ${pids[-1]}
    fi
  done
  if start dev_moe $q serve model.preset=tiny-moe model.backend=cuda serve.kv_mib=8 serve.model_name=q3vl-tiny; then
    node_c answers $tmp/d/eval.jsonl >$tmp/a_dev_moe.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
    ref=$tmp/gen_moe.jsonl same_answers "MoE on CUDA: answers == generate on the CPU" $tmp/a_dev_moe.jsonl
  fi
else
  skip "serve on CUDA: 1 and 2 ranks, MoE" "no GPU visible: tools/gpu's checks run them on the GPU machine"
fi
# Pipeline stages (serve.pp): 2 stages of 1 rank, 2 stages of 2 tensor-parallel ranks, and the MoE model in 2; each
# rank holds only its stage's layers, the hidden states go from stage to stage; answers stay generate's.
for lay in "2 2 tiny gen" "4 2 tiny gen" "2 2 tiny-moe gen_moe"; do
  read -r n pp m g <<<"$lay"
  if start pp$n$m mpiexec -n $n $q serve model.preset=$m serve.pp=$pp serve.kv_mib=8 serve.model_name=q3vl-tiny; then
    grep -q "serve: pipeline of $pp stages of $((n / pp)) rank(s) each" $tmp/pp$n$m.log || bad "pp$n$m: $(grep serve: $tmp/pp$n$m.log)"
    node_c answers $tmp/d/eval.jsonl stream >$tmp/a_pp$n$m.jsonl 2>$tmp/err.log || bad "client: $(tail -3 $tmp/err.log)"
    ref=$tmp/$g.jsonl same_answers "$m, $pp stages x TP $((n / pp)): streamed answers == generate" $tmp/a_pp$n$m.jsonl
    kill -TERM ${pids[-1]}; wait ${pids[-1]}
  fi
done
expect nccl-needs-gpu 1 'serve.tp_comm = "nccl" needs the model on GPUs' \
  mpiexec -n 2 $q serve model.preset=tiny serve.tp_comm=nccl serve.port=0
expect pp-layout 1 'serve.tp x serve.pp must be the number of ranks' mpiexec -n 3 $q serve model.preset=tiny serve.pp=2
stop_all
expect no-model 1 "serve needs a model" $q serve serve.port=0
expect bad-image-dir 1 "serve.image_dir" $q serve model.preset=tiny serve.image_dir=$tmp/nothere
finish
