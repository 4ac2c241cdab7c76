#!/usr/bin/env bash
# Serving's vision passes and step profile on a random tiny model, CPU op layer (a Python client, no Node): six
# requests with images at once are admitted together and encoded in fewer passes of the vision tower
# (serve.vision_batch) than requests, with generate's greedy answers, as with a pass per request; serve.profile_steps
# logs a decode-only and a mixed step's per-op table and host phases, and one JSON line each whose phases add up to
# the step.
source "$(dirname "$0")/../lib.sh"

$q synth synth.dir=$tmp/d synth.train_samples=1 synth.eval_samples=6 synth.seed=3 run.timing=false >/dev/null 2>&1 ||
  { bad "synth failed"; finish; }
$q generate model.preset=tiny generate.prompts=$tmp/d/eval.jsonl generate.min_pixels=4096 generate.max_new_tokens=6 \
  generate.output=$tmp/gen.jsonl run.timing=false >$tmp/gen.log 2>&1 || bad "generate failed: $(tail -3 $tmp/gen.log)"

# ask NAME ARGS...: a server with ARGS, every eval prompt sent at once (greedy, 6 tokens), answers in $tmp/NAME.jsonl
# (generate's record format: line, answer), its /metrics in $tmp/NAME.metrics; the server stopped.
ask() {
  local name=$1 port pid; shift
  $q serve model.preset=tiny serve.port=0 serve.min_pixels=4096 serve.max_tokens=6 serve.model_name=m run.timing=false "$@" \
    >$tmp/$name.log 2>&1 &
  pid=$!
  port=$(server_port $tmp/$name.log $pid) || { bad "$name: the server did not come up: $(tail -5 $tmp/$name.log)"; return 1; }
  $py - "$port" $tmp/d/eval.jsonl $tmp/$name.jsonl <<'EOF' 2>>$tmp/$name.log || bad "$name: the client failed: $(tail -3 $tmp/$name.log)"
import base64, json, os, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, evalf, outf = sys.argv[1:4]
recs = [json.loads(l) for l in open(evalf) if l.strip()]
def ask(i):
    user = next(m for m in recs[i]["messages"] if m["role"] == "user")
    content = []
    for p in user["content"]:
        if p["type"] == "image":
            b = base64.b64encode(open(os.path.join(os.path.dirname(evalf), p["image"]), "rb").read()).decode()
            content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + b}})
        else:
            content.append({"type": "text", "text": p["text"]})
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return {"line": i + 1, "answer": json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]}
with ThreadPoolExecutor(len(recs)) as ex:
    res = list(ex.map(ask, range(len(recs))))
with open(outf, "w") as f:
    for r in res: f.write(json.dumps(r) + "\n")
EOF
  curl -sf -m 5 http://127.0.0.1:$port/metrics >$tmp/$name.metrics
  kill -TERM $pid; wait $pid
}
# same NAME: its answers equal generate's.
same() {
  $py - $tmp/gen.jsonl $tmp/$1.jsonl <<'EOF' && pass "$1: generate's greedy answers" || bad "$1: answers differ: $(head -c 600 $tmp/$1.jsonl)"
import json, sys
gen = {r["line"]: r["answer"] for r in map(json.loads, open(sys.argv[1]))}
got = [json.loads(l) for l in open(sys.argv[2])]
assert len(got) == len(gen) == 6 and all(r["answer"] == gen[r["line"]] for r in got)
EOF
}
metric() { grep -oP "^$2 \K[0-9.e+]+" $tmp/$1.metrics; }

ask batched serve.profile_steps=1 serve.profile_rows=2 && same batched
enc=$(metric batched q3vl_engine_vision_encodes_total) passes=$(metric batched q3vl_engine_vision_passes_total)
holds "x[0] == 6 and x[1] < x[0]" "$enc" "$passes" && pass "vision: 6 requests in $passes passes" ||
  bad "vision: $enc requests in $passes passes"
ask single serve.vision_batch=false && same single
enc=$(metric single q3vl_engine_vision_encodes_total) passes=$(metric single q3vl_engine_vision_passes_total)
holds "x[0] == 6 and x[1] == 6" "$enc" "$passes" && pass "serve.vision_batch=false: a pass per request" ||
  bad "serve.vision_batch=false: $enc requests in $passes passes"

# The profile: one decode-only and one mixed step of 2+ rows, each a table (phases, ops) and a JSON line.
for kind in decode-only mixed; do
  grep -qE "serve profile: a $kind step of [0-9]+ rows" $tmp/batched.log &&
    grep -qE "serve profile:   (embedding_fwd|linear|matmul|gemm)" $tmp/batched.log &&
    pass "profile: a $kind step's table" || bad "profile: no $kind table: $(grep 'serve profile' $tmp/batched.log | head -5)"
done
grep -oP 'serve profile json: \K.*' $tmp/batched.log >$tmp/prof.jsonl
$py - $tmp/prof.jsonl <<'EOF' && pass "profile: JSON lines, phases adding up to the step" || bad "profile JSON: $(head -c 800 $tmp/prof.jsonl)"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert sorted(r["kind"] for r in rs) == ["decode-only", "mixed"], [r["kind"] for r in rs]
for r in rs:
    assert r["rows"] >= 2 and r["step_ms"] > 0 and r["device"] == "cpu", r
    names = [p["name"] for p in r["phases"]]
    assert names[3].startswith("device work") and names[-1] == "host / unaccounted", names
    assert abs(sum(p["ms"] for p in r["phases"]) - r["step_ms"]) < 1e-6 * max(1, r["step_ms"]), r["phases"]
    assert all(p["ms"] >= 0 for p in r["phases"][:-1]) and r["phases"][3]["ms"] > 0, r["phases"]
    assert r["ops"] and sum(o["ms"] for o in r["ops"]) <= r["phases"][3]["ms"] * 1.05 + 0.5, (r["ops"], r["phases"])
    assert (r["kind"] == "mixed") == (r["prompt_tokens"] > 0), r
EOF
finish
