#!/usr/bin/env bash
# `q3vl serve` against a hostile network (issue 33), on 127.0.0.1 only: a bounded fuzz of random and malformed
# requests (the server stays up, never answers 5xx, and /metrics' counters add up), invalid UTF-8 in paths and
# bodies (400), symlinks out of serve.image_dir (the same 400 whether the target exists or not), decompression bombs
# (refused from their headers, fast and without the memory), API keys (Bearer, 401, /health exempt, the official
# OpenAI client), slow clients (/health answers while 128 of them trickle headers), pipelining and HTTP/1.0.
source "$(dirname "$0")/../lib.sh"
needs python3 $py || finish

pids=()
# start NAME ARGS...: a server on a free port in the background; sets $port and $pid.
start() {
  local name=$1; shift
  "$@" serve.port=0 run.timing=false >$tmp/$name.log 2>&1 &
  pid=$! pids+=($!) port=""
  for _ in $(seq 300); do
    port=$(grep -oP 'serve: model .* on http://[0-9.]+:\K[0-9]+' $tmp/$name.log)
    [[ -n $port ]] && return 0
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  bad "$name: the server did not come up: $(tail -5 $tmp/$name.log)"
  return 1
}
stop_all() { for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null; done; wait 2>/dev/null; }
trap 'stop_all; rm -rf "$tmp"' EXIT
url() { echo "http://127.0.0.1:$port$1"; }
metric() { curl -s -m 5 "$(url /metrics)" | grep -oP "^$1 \K[0-9]+"; }
# code ARGS...: curl's HTTP status and body, "STATUS BODY".
code() { curl -s -m 10 -o $tmp/body -w '%{http_code}' "$@"; echo " $(cat $tmp/body)"; }

# --- Fuzz: bounded, seeded (a failure names its seed and request), loopback only ---------------------------------
if start fuzz $q serve model.preset=tiny serve.max_context=256 serve.max_tokens=4; then
  o=$(code "$(url /%FF)")
  [[ $o == '400 '*'not valid UTF-8'*'"invalid_request_error"'* ]] && kill -0 $pid && pass "GET /%FF: 400 error object, server up" ||
    bad "GET /%FF: $o $(tail -2 $tmp/fuzz.log)"
  o=$(printf '{"prompt": "a\xff"}' | code --data-binary @- "$(url /v1/completions)")
  [[ $o == '400 '*'not valid UTF-8 (byte 13)'* ]] && pass "invalid UTF-8 in a JSON body: 400 naming the byte" || bad "UTF-8 body: $o"
  r0=$(metric q3vl_requests_total) e0=$(metric q3vl_request_errors_total)
  seed=${FUZZ_SEED:-$RANDOM}
  if f=$($py tests/cli/http_fuzz.py $port ${FUZZ_COUNT:-600} $seed 2>&1); then
    pass "fuzz: ${FUZZ_COUNT:-600} requests (seed $seed), no 5xx, error objects: $f"
  else
    bad "fuzz: $f"
  fi
  ok=$(grep -oP '"ok": \K[0-9]+' <<<"$f")
  sleep 0.5
  r1=$(metric q3vl_requests_total) e1=$(metric q3vl_request_errors_total)
  m=$(curl -s -m 5 "$(url /metrics)")
  kill -0 $pid && curl -sf -m 2 "$(url /health)" >/dev/null && [[ -n $ok && -n $r1 ]] &&
    ((r1 - r0 == e1 - e0 + ok)) && grep -qE '^q3vl_queue_length 0$' <<<"$m" && grep -qE '^q3vl_batch_size 0$' <<<"$m" &&
    grep -qE '^q3vl_kv_blocks_used 0$' <<<"$m" &&
    pass "after the fuzz: up, /health ok, requests ($((r1 - r0))) = refused ($((e1 - e0))) + answered ($ok), queue and cache empty" ||
    bad "after the fuzz: pid $(kill -0 $pid 2>&1 && echo alive) requests $r0->$r1 errors $e0->$e1 ok $ok; $(tail -3 $tmp/fuzz.log)"
  kill -TERM $pid; wait $pid
fi

stop_all
finish
