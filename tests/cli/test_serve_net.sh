#!/usr/bin/env bash
# `q3vl serve` against a hostile network (issue 33), on 127.0.0.1 only: a bounded fuzz of random and malformed
# requests (the server stays up, never answers 5xx, and /metrics' counters add up), invalid UTF-8 in paths and
# bodies (400), symlinks out of serve.image_dir (the same 400 whether the target exists or not), decompression bombs
# (refused from their headers, fast and without the memory), API keys (Bearer, 401, /health exempt, the official
# OpenAI client), slow clients (/health answers within 1 s while 128 of them trickle heads; they get 408), three
# pipelined requests answered, and a streamed answer to HTTP/1.0 without chunked encoding.
source "$(dirname "$0")/../lib.sh"
needs python3 $py || finish

pids=()
# start NAME ARGS...: a server on a free port in the background; sets $port and $pid.
start() {
  local name=$1; shift
  "$@" serve.port=0 run.timing=false >$tmp/$name.log 2>&1 &
  pid=$! pids+=($!)
  port=$(server_port $tmp/$name.log $pid) && return 0
  bad "$name: the server did not come up: $(tail -5 $tmp/$name.log)"
  return 1
}
stop_all() { for p in "${pids[@]}"; do kill -TERM $p 2>/dev/null; done; wait 2>/dev/null; }
trap 'stop_all; rm -rf "$tmp"' EXIT
url() { echo "http://127.0.0.1:$port$1"; }
metric() { curl -s -m 5 "$(url /metrics)" | grep -oP "^$1 \K[0-9]+"; }
# code ARGS...: curl's HTTP status and body, "STATUS BODY".
code() { curl -s -m 10 -o $tmp/body -w '%{http_code}' "$@"; echo " $(cat $tmp/body)"; }

# The images: one inside serve.image_dir; links from inside to a picture and a text file outside it; bombs (small
# files of 12000x12000 pixels: a PNG of zeros, 140 KB of zlib; a JPEG); a PNG whose header is right and whose data
# is not (decoding it fails: a request that is answered otherwise decoded nothing).
mkdir -p $tmp/imgs $tmp/outside
$py - $tmp <<'EOF' || bad "making the test images failed"
import base64, struct, sys, zlib
from PIL import Image
d = sys.argv[1]
Image.new("RGB", (64, 48), (200, 30, 90)).save(f"{d}/imgs/in.png")
Image.new("RGB", (256, 256), (20, 130, 90)).save(f"{d}/imgs/big.png")
Image.new("RGB", (64, 48), (10, 30, 90)).save(f"{d}/outside/secret.png")
open(f"{d}/outside/notes.txt", "w").write("not a picture\n")
def png(w, h, idat):
    chunk = lambda t, b: struct.pack(">I", len(b)) + t + b + struct.pack(">I", zlib.crc32(t + b))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
z = zlib.compressobj(9)
idat = b"".join(z.compress(b"\0" * 12001) for _ in range(12000)) + z.flush()
open(f"{d}/bomb.png", "wb").write(png(12000, 12000, idat))
open(f"{d}/broken.png", "wb").write(png(300, 300, b"\x78\x9c garbage"))
Image.new("L", (12000, 12000), 128).save(f"{d}/bomb.jpg", quality=50)
for n in ("bomb.png", "bomb.jpg", "broken.png"):
    open(f"{d}/{n}.b64", "w").write(base64.b64encode(open(f"{d}/{n}", "rb").read()).decode())
EOF
ln -s $tmp/outside/secret.png $tmp/imgs/link.png
ln -s $tmp/outside/notes.txt $tmp/imgs/text.txt
# chat URL...: a chat request body with these images (a data: URL for a file name ending in .b64) and a question.
chat() {
  $py - "$@" <<'EOF'
import json, sys
url = lambda u: "data:image/png;base64," + open(u).read() if u.endswith(".b64") else u
parts = [{"type": "image_url", "image_url": {"url": url(u)}} for u in sys.argv[1:]]
print(json.dumps({"messages": [{"role": "user", "content": parts + [{"type": "text", "text": "What is it?"}]}],
                  "max_tokens": 2, "temperature": 0}))
EOF
}
post_chat() {
  chat "$@" >$tmp/req.json
  code -H 'Content-Type: application/json' --data-binary @$tmp/req.json "$(url /v1/chat/completions)"
}
rss() { grep -oP "^$1:\s+\K[0-9]+" /proc/$pid/status; }  # kB

# --- Fuzz: bounded, seeded (a failure names its seed and request), loopback only ---------------------------------
if start fuzz $q serve model.preset=tiny serve.max_context=256 serve.max_tokens=4 serve.read_timeout=2; then
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

if start images $q serve model.preset=tiny serve.max_context=512 serve.max_tokens=4 serve.image_dir=$tmp/imgs \
    serve.min_pixels=4096 serve.max_pixels=65536; then
  # serve.image_dir: a path is judged by the file it opens. Outside, through a link after a missing component, a
  # text file outside, or missing: the same 400, which says nothing of what exists outside.
  o=$(post_chat in.png)
  [[ $o == 200* ]] && pass "image_dir: a picture inside is read" || bad "image_dir inside: $o"
  for p in nonexist/../link.png link.png nonexist/../text.txt text.txt $tmp/outside/secret.png missing.png \
           ../outside/secret.png; do
    o=$(post_chat $p)
    [[ $o == "400 "*"'$p' is not a readable file under serve.image_dir"* ]] && pass "image_dir: '$p' refused, 400" ||
      bad "image_dir: '$p': $o"
  done

  # Bombs: four 12000x12000 PNGs (144 Mpx each, past serve.max_image_pixels = 64 Mpx; a PNG cannot be decoded
  # smaller) refused from their headers, in well under a second, with no memory to speak of.
  rss0=$(rss VmRSS) t0=$(date +%s.%N)
  o=$(post_chat $tmp/bomb.png.b64 $tmp/bomb.png.b64 $tmp/bomb.png.b64 $tmp/bomb.png.b64)
  dt=$($py -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" $t0 $(date +%s.%N))
  extra=$(( ($(rss VmHWM) - rss0) / 1024 ))
  [[ $o == "413 "*"image 1 is 12000x12000 (144000000 pixels decoded)"*"serve.max_image_pixels"* ]] &&
    $py -c "import sys; sys.exit(not float(sys.argv[1]) < 1)" $dt && ((extra < 100)) &&
    pass "4 PNG bombs in one request: 413 in $dt s, at most $extra MB more RSS at the peak" ||
    bad "PNG bombs: $dt s, $extra MB: ${o:0:300}"
  # What cannot fit serve.max_context is refused before anything is decoded: 8 images of 66 tokens past 512, the
  # first of which would fail to decode (422) had it been.
  o=$(post_chat $tmp/broken.png.b64 big.png big.png big.png big.png big.png big.png big.png)
  [[ $o == "413 "*"image 8 is 256x256: the images so far become 528 tokens; this server's context is 512"* ]] &&
    pass "images past serve.max_context: 413 before decoding" || bad "context from headers: ${o:0:300}"
  o=$(post_chat $tmp/broken.png.b64)
  [[ $o == "422 "*"image 1: corrupt"* ]] && pass "that corrupt PNG alone: 422" || bad "broken PNG: ${o:0:300}"
  # A JPEG bomb is decoded at 1/2 (36 Mpx, within the budget, still above the model's 256x256): answered, for a
  # fraction of the 576 MB a full decode to RGB takes.
  rss0=$(rss VmRSS)
  o=$(post_chat $tmp/bomb.jpg.b64)
  extra=$(( ($(rss VmHWM) - rss0) / 1024 ))
  [[ $o == 200* ]] && ((extra < 300)) && pass "a 12000x12000 JPEG: answered from a scaled decode ($extra MB more RSS)" ||
    bad "JPEG bomb: $extra MB: ${o:0:300}"
  kill -TERM $pid; wait $pid
fi

# --- Slow clients, pipelining, HTTP/1.0 ---------------------------------------------------------------------------
# 128 clients from one address trickle a head a byte a second (the limit per address is 64: the oldest slow ones are
# closed for newer connections; the rest get 408 at serve.header_timeout): /health answers within a second all along.
if start slow $q serve model.preset=tiny serve.max_context=256 serve.header_timeout=4 serve.http_threads=8; then
  o=$($py tests/cli/http_slow.py $port slow 128 7 2>&1)
  $py - "$o" <<'EOF' && pass "128 slow clients: /health within 1 s every time, the slow ones closed: $o" || bad "slow clients: $o"
import json, sys
r = json.loads(sys.argv[1])
assert r["probes"] >= 5 and r["failed"] == 0 and r["worst"] < 1.0, r
assert r["ends"]["open"] == 0 and r["ends"]["408"] >= 1, r
EOF
  o=$($py tests/cli/http_slow.py $port pipeline 3 2>&1)
  [[ $o == 3 ]] && pass "3 pipelined requests: 3 answers" || bad "pipelining: $o answers"
  o=$($py tests/cli/http_slow.py $port http10 2>&1)
  $py - "$o" <<'EOF' && pass "HTTP/1.0 stream: no chunked encoding, events until [DONE], then closed: $o" || bad "HTTP/1.0 stream: $o"
import json, sys
r = json.loads(sys.argv[1])
assert r["status"] == "200" and r["framing"] == ["Connection: close"] and r["events"] >= 2 and r["done"] and r["closed"], r
EOF
  curl -sf -m 2 "$(url /health)" >/dev/null && pass "server up after the slow clients" || bad "server down: $(tail -3 $tmp/slow.log)"
  kill -TERM $pid; wait $pid
fi

# --- Tensor parallel with a stopped rank ---------------------------------------------------------------------------
# rank_pid PID RANK: the process of MPI rank RANK below PID (mpiexec's proxies set PMI_RANK).
descendants() {
  local f st ppid
  for f in /proc/[0-9]*/stat; do
    { read -r st <"$f"; } 2>/dev/null || continue
    read -r _ ppid _ <<<"${st##*) }"
    [[ $ppid == "$1" ]] && { f=${f#/proc/}; echo "${f%/stat}"; descendants "${f%/stat}"; }
  done
}
rank_pid() {
  local p
  for p in $(descendants "$1"); do
    grep -qx "PMI_RANK=$2" <<<"$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)" && { echo "$p"; return; }
  done
}
# TP = 2, runtime.timeout = 6 s, rank 1 stopped (SIGSTOP) before a request: /health turns 503 while the step hangs,
# the request gets an error, and the server exits non-zero within the timeout + 5 s naming rank 1 and the collective.
if needs "tp-stopped-rank" mpiexec && start tpstop timeout -k 3 60 mpiexec -n 2 $q serve model.preset=tiny \
    serve.kv_mib=8 runtime.timeout=6 serve.max_tokens=4; then
  r1=$(rank_pid $pid 1)
  kill -STOP $r1
  t0=$(date +%s%N)
  curl -s -m 30 -o $tmp/tpstop.json -w '%{http_code}' -d '{"prompt": "hi"}' "$(url /v1/completions)" >$tmp/tpstop.code &
  sleep 4.5
  h=$(curl -s -m 2 -w ' %{http_code}' "$(url /health)")
  wait $pid; rc=$?
  dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  kill -CONT $r1 2>/dev/null; wait
  [[ $h == *'a rank of the group does not answer'*'"status":"unhealthy"'*' 503' ]] && pass "stopped rank: /health 503 before the end" ||
    bad "stopped rank: /health said $h"
  ((rc != 0 && rc != 124 && dt < 11000)) && grep -qE "watchdog: collective .* did not complete within runtime.timeout = 6 s.*(rank 1|1 at #)" $tmp/tpstop.log &&
    pass "stopped rank: the server exits ($rc) in $dt ms, naming rank 1" ||
    bad "stopped rank: exit $rc after $dt ms: $(grep -E 'watchdog|error' $tmp/tpstop.log | head -3)"
  [[ $(cat $tmp/tpstop.code) == 503 ]] && grep -q 'the server stopped: watchdog' $tmp/tpstop.json &&
    pass "stopped rank: the open request answered 503" || bad "stopped rank: request $(cat $tmp/tpstop.code) $(cat $tmp/tpstop.json)"
  ! grep -qE "munmap_chunk|double free|corrupted|Segmentation" $tmp/tpstop.log && pass "stopped rank: no memory corruption" ||
    bad "stopped rank: $(grep -E 'munmap_chunk|double free|corrupted|Segmentation' $tmp/tpstop.log)"
fi

# --- From a job folder: the checkout's binary and an installed one find their tokenizer -----------------------------
mkdir -p $tmp/job
for how in checkout installed; do
  if [[ $how == installed ]]; then
    make -s install PREFIX=$tmp/inst >$tmp/install.log 2>&1 || { bad "make install: $(tail -3 $tmp/install.log)"; continue; }
    exe=$tmp/inst/bin/q3vl
    [[ -f $tmp/inst/share/q3vl/tokenizer.json && -f $tmp/inst/share/q3vl/input/train_tiny.deck &&
       -f $tmp/inst/share/q3vl/jobs/common.sh && -x $tmp/inst/share/q3vl/tools/summarize ]] &&
      grep -qx "set root $tmp/inst" $tmp/inst/share/modulefiles/q3vl/* && pass "make install: binary, data, modulefile" ||
      bad "make install: $(ls -R $tmp/inst | head -20)"
  else
    exe=$(realpath $q)
  fi
  cd $tmp/job
  started=0; start job_$how $exe serve model.preset=tiny serve.max_context=256 && started=1
  cd - >/dev/null
  if ((started)); then
    o=$(code -d '{"prompt": "hi", "max_tokens": 2}' "$(url /v1/completions)")
    [[ $o == 200* ]] && pass "serve from a job folder ($how binary)" || bad "job folder ($how): $o"
    kill -TERM $pid; wait $pid
  fi
done

# --- API keys: Q3VL_API_KEY (the deck's serve.api_key is the same key, hidden in the log's echo) -----------------
if start auth env Q3VL_API_KEY=sekret-42 $q serve model.preset=tiny serve.max_context=256 serve.max_tokens=2; then
  o=$(code "$(url /health)")
  [[ $o == '200 '* ]] && pass "api key: /health needs none" || bad "api key /health: $o"
  o=$(code "$(url /metrics)")
  [[ $o == '401 '*'"code":"invalid_api_key"'*'an API key is required'* ]] && pass "api key: none sent, 401 error object" ||
    bad "api key none: $o"
  o=$(code -H 'Authorization: Bearer sekret-4' "$(url /v1/models)")
  [[ $o == '401 '*'incorrect API key'* ]] && pass "api key: a wrong one, 401" || bad "api key wrong: $o"
  o=$(code -H 'Authorization: Bearer sekret-42' "$(url /v1/models)")
  [[ $o == '200 '*'"object":"list"'* ]] && pass "api key: the right one, 200" || bad "api key right: $o"
  # The official OpenAI client: its apiKey goes through, a wrong one is its AuthenticationError (401).
  if needs openai-client node && [[ -f third_party/npm/node_modules/openai/package.json ]]; then
    o=$(Q3VL_CLIENT_KEY=sekret-42 node tests/cli/serve_client.mjs $port q3vl-tiny hello 2>&1)
    [[ $(grep -c '"ok":true' <<<"$o") == 2 ]] && pass "api key: the openai client's apiKey, streamed and not" ||
      bad "openai client with the key: $o"
    o=$(Q3VL_CLIENT_KEY=wrong node tests/cli/serve_client.mjs $port q3vl-tiny hello 2>&1)
    [[ $(grep -c '"status":401,"code":"invalid_api_key"' <<<"$o") == 2 ]] && pass "api key: the openai client, wrong key: 401" ||
      bad "openai client with a wrong key: $o"
  fi
  kill -TERM $pid; wait $pid
fi
# Listening beyond loopback without a key is said at start; a key in the deck is hidden in the log's echo.
if start open $q serve model.preset=tiny serve.host=0.0.0.0; then
  kill -TERM $pid; wait $pid
  grep -q "listening on 0.0.0.0 without an API key" $tmp/open.log && pass "no key on 0.0.0.0: warned" ||
    bad "no warning: $(grep serve: $tmp/open.log)"
fi
if start keyed $q serve model.preset=tiny serve.host=0.0.0.0 serve.api_key=deck-key-7; then
  kill -TERM $pid; wait $pid
  ! grep -q "without an API key" $tmp/keyed.log && grep -q 'api_key = "<hidden>"' $tmp/keyed.log &&
    ! grep -q deck-key-7 $tmp/keyed.log && pass "key in the deck: no warning, hidden in the echo" ||
    bad "keyed: $(grep -E 'api_key|API key' $tmp/keyed.log)"
fi

stop_all
finish
