#!/usr/bin/env bash
# Issue 18's GPU checks in one call on the GPU machine (from the repo root, the packed runtime sourced):
#   tools/gpu/serve_checks.sh Q3VL UNIT_TESTS OUTDIR [PARTS]     PARTS: "unit tiny 8b 30b" (default: all; a call is 600 s)
#   more parts: nccl (NcclComm and the device model's TP sums, bin/mpi_tests at 2 and 4 ranks as $MPI_TESTS; serve with
#   serve.tp_comm=nccl against generate), 8btp2 (the 8B shape on 2 ranks, NCCL and MPI sums; on a machine with a GPU
#   a rank only: two ranks sharing one GPU talk over sockets between time-sliced contexts, and the 8B's first request
#   did not finish in 60 s, with or without graphs, on an H100 on 2026-12-05), hfbase (transformers'
#   generate on the 8B shape: the PyTorch baseline), video (serving videos on CUDA against generate on the CPU, the 8B
#   shape's time to first token on a 30 s clip), tpstop (a TP 2 server with a stopped rank, issue 33), 8bpp, 8bint8, 8bfp8, 30bint8, 30bfp8, 8bnog and 30bnog (model.cuda_graphs = false: decode
#   steps launched op by op, against the default's graphs), 8btp2g (8btp2's NCCL run with Q3VL_TP_GRAPHS=1: decode
#   steps as graphs holding the NCCL sums), 8btpot (serve.max_tpot_ms = 14), 8bnovb
#   (serve.vision_batch = false: a vision pass per request, the A/B of the batched one), and on machines with a GPU a
#   rank (issue 35: tools/gpu/multi_checks.sh) 30btp2 (serve.tp = 2 over NCCL), 30bpp (serve.pp = 2), 30btp4, 30bauto
#   (2 ranks, serve.tp = serve.pp = 0: the automatic layout), and 30bep2, 30bep4, 30bep8 (serve.tp = serve.ep = 2, 4,
#   8 over NCCL: whole experts per rank). CONC: the concurrencies
#   bench_serve runs at (default "1 32"; 3 x c requests each). PROFILE=N (the big shapes): serve.profile_steps = N
#   decode-only and N mixed steps of at least PROFILE_ROWS rows (default 56) profiled op by op, their tables in
#   summary.txt and profile_NAME.txt, their JSON in profile_NAME.jsonl (the steps run without graphs: the bench's
#   numbers count them).
# - the GPU unit suites with Q3VL_REQUIRE_GPU=1: the op table (paged attention among them), serving on the device
#   model against the host model on the golden models (DevInfer.*), and the earlier device-model suites;
# - `q3vl serve` with model.backend = cuda against `q3vl generate` on the CPU: the same greedy answers for 16
#   held-out prompts with images, random tiny dense and MoE models, 1 rank and 2 tensor-parallel ranks, fp32; bf16
#   agreement reported;
# - the 8B and 30B-A3B shapes (random weights streamed to the device, bf16) served from one H200: load, memory, and
#   tools/bench_serve's throughput, time to first token and per output token at concurrency 1 and 32.
# Everything lands in OUTDIR/results.tgz, refreshed after every part so that a call cut short returns what finished.
set -u
q=$1 ut=$2 final=$3 parts=${4:-unit tiny 8b 30b} out=/tmp/results
part() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out" "$final"
pack() { tar czf "$final/results.tgz" -C "$out" . && cp "$out/summary.txt" "$final/"; }
export OPENBLAS_NUM_THREADS=1
say() { echo "$*" >>"$out/summary.txt"; }
nvidia-smi -L >"$out/summary.txt"
say "node: $(command -v node || echo none)"

t0=$SECONDS
if part unit; then
Q3VL_REQUIRE_GPU=1 timeout 200 "$ut" --gtest_filter='BackendOps.*:DevInfer.*:DevLayers.*:DevVision.*:DevModel.*:Golden.*:StreamWeights.*:Profile.*' \
  >"$out/unit.log" 2>&1
say "unit: rc=$? $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/unit.log" | tr '\n' ' ')"
grep -E 'paged_attention.*(FAIL|fail)|^\[  FAILED|on cuda (fp32|bf16|fp16):' "$out/unit.log" >>"$out/summary.txt"
pack
fi

# ---- serve on the GPU against generate on the CPU -------------------------------------------------------------
d=/tmp/d
"$q" synth synth.dir=$d synth.train_samples=1 synth.eval_samples=16 synth.seed=3 run.timing=false >/dev/null 2>&1
for m in tiny tiny-moe; do
  "$q" generate model.preset=$m generate.prompts=$d/eval.jsonl generate.min_pixels=4096 generate.max_new_tokens=16 \
    generate.output=/tmp/gen_$m.jsonl run.timing=false >"$out/gen_$m.log" 2>&1 || say "generate $m failed"
done
# answers PORT EVAL OUT [CONCURRENCY]: greedy chat answers for every record (its user turn, images as data URLs).
answers() {
  python3 - "$@" <<'EOF'
import base64, json, os, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, evalf, outf = sys.argv[1], sys.argv[2], sys.argv[3]
conc = int(sys.argv[4]) if len(sys.argv) > 4 else 1
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
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=600))
    return {"line": i + 1, "answer": r["choices"][0]["message"]["content"], "usage": r["usage"]}
with ThreadPoolExecutor(conc) as ex:
    res = list(ex.map(ask, range(len(recs))))
with open(outf, "w") as f:
    for r in res: f.write(json.dumps(r) + "\n")
EOF
}
# compare GEN GOT: how many answers equal generate's
compare() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
gen = {r["line"]: r["answer"] for r in map(json.loads, open(sys.argv[1]))}
got = [json.loads(l) for l in open(sys.argv[2])]
same = sum(gen[r["line"]] == r["answer"] for r in got)
print(f"{same}/{len(gen)} answers equal generate's")
EOF
}
# serve_case NAME TIMEOUT CMD...: a server on a free port, the 16 answers, compared with generate's
serve_case() {
  local name=$1 t=$2; shift 2
  local t0=$SECONDS port="" ref=/tmp/gen_tiny.jsonl
  [[ $name == *moe* ]] && ref=/tmp/gen_tiny-moe.jsonl
  timeout "$t" "$@" serve.port=0 serve.min_pixels=4096 serve.model_name=m run.timing=false >"$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' "$out/$name.log")
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  if [[ -z $port ]]; then say "$name: did not come up: $(tail -2 "$out/$name.log" | tr '\n' ' ')"; pack; return; fi
  answers "$port" $d/eval.jsonl "$out/$name.jsonl" 4 2>>"$out/$name.log"
  say "$name: $(compare $ref "$out/$name.jsonl" 2>&1 | tail -1) ($((SECONDS - t0)) s); $(grep -oP 'serve: on .*' "$out/$name.log" | head -1)"
  kill -TERM $pid; wait $pid
  pack
}
# generate on the GPU (the weights streamed to the device) against generate on the CPU: the same greedy answers.
if part gencuda; then
  for m in tiny tiny-moe; do
    "$q" generate model.preset=$m model.backend=cuda generate.prompts=$d/eval.jsonl generate.min_pixels=4096 \
      generate.max_new_tokens=16 generate.output=/tmp/gencuda_$m.jsonl run.timing=false >"$out/gencuda_$m.log" 2>&1
    say "generate on cuda, $m: rc=$? $(cmp -s /tmp/gencuda_$m.jsonl /tmp/gen_$m.jsonl && echo 'answers == CPU' || echo 'answers DIFFER'); $(grep -oE 'weights streamed[^;]*' "$out/gencuda_$m.log" | head -1)"
  done
  pack
fi

# Videos (issue 31), clips made on the build machine and carried in devpack/clips (the GPU machine has no ffmpeg):
# serve on CUDA against generate on the CPU, seeded samples (temperature 1, generate's seed for its first prompt, so
# one generate per prompt); then the 8B shape (random weights, bf16) serving a 30 s clip at 2 fps: time to first
# token cold and again (the prefix cache), the prompt's tokens, memory.
# vask PORT DIR CLIP MAX_TOKENS [SEED]: one chat request with the clip as a data: URL; prints one JSON line.
vask() {
  python3 - "$@" <<'EOF2'
import base64, json, sys, time, urllib.request
port, d, clip, mt = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
url = "data:video/mp4;base64," + base64.b64encode(open(f"{d}/{clip}", "rb").read()).decode()
body = {"model": "m", "max_tokens": mt, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What moves?"}]}]}
if len(sys.argv) > 5: body.update(temperature=1, seed=int(sys.argv[5]))
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t0 = time.time()
try:
    r = json.load(urllib.request.urlopen(req, timeout=600))
    print(json.dumps({"answer": r["choices"][0]["message"]["content"], "usage": r["usage"], "s": time.time() - t0}))
except urllib.error.HTTPError as e:
    print(json.dumps({"error": e.code, "body": e.read().decode()[:400], "s": time.time() - t0}))
EOF2
}
vserver() {  # vserver LOG ARGS...: a server in the background; sets vport and vpid
  "$q" serve serve.port=0 serve.image_dir=/tmp/vd serve.model_name=m run.timing=false "${@:2}" >"$1" 2>&1 &
  vpid=$! vport=""
  for _ in $(seq 900); do
    vport=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' "$1") && break
    kill -0 $vpid 2>/dev/null || break
    sleep 0.2
  done
  [[ -n $vport ]]
}
if part video; then
  rm -rf /tmp/vd && cp -r devpack/clips /tmp/vd
  for m in tiny tiny-moe; do
    for c in clip.mp4 clip2.mp4; do
      printf '{"messages": [{"role": "user", "content": [{"type": "video", "video": "%s"}, {"type": "text", "text": "What moves?"}]}]}\n' $c >/tmp/vd/p_$c.jsonl
      "$q" generate model.preset=$m generate.prompts=/tmp/vd/p_$c.jsonl generate.max_new_tokens=8 generate.temperature=1 \
        generate.output=/tmp/vd/gen_${m}_$c.jsonl run.timing=false >"$out/vgen_${m}_$c.log" 2>&1 || say "video generate $m $c failed"
    done
    if vserver "$out/vserve_$m.log" model.preset=$m model.backend=cuda serve.max_context=2048; then
      for c in clip.mp4 clip2.mp4; do
        got=$(vask $vport /tmp/vd $c 8 1234)
        say "video $m $c: serve on cuda $(python3 -c 'import json,sys; g=json.loads(open(sys.argv[1]).readline()); r=json.loads(sys.argv[2]); print("PASS == generate on the CPU" if r.get("answer")==g["answer"] and r["usage"]["prompt_tokens"]==g["prompt_tokens"] else f"FAIL {r} vs {g}")' /tmp/vd/gen_${m}_$c.jsonl "$got")"
      done
    else
      say "video $m: the server did not come up: $(tail -2 "$out/vserve_$m.log" | tr '\n' ' ')"
    fi
    kill -TERM $vpid; wait $vpid
    pack
  done
  if vserver "$out/vserve_8b.log" model.preset=8B model.backend=cuda model.dtype=bf16 serve.max_context=16384; then
    say "8B video: $(grep -oP 'serve: on .*' "$out/vserve_8b.log" | head -1)"
    for i in 1 2; do say "8B video, 30 s clip (request $i): $(vask $vport /tmp/vd clip30.mp4 1)"; done
    say "8B video, 30 s clip, 16 tokens: $(vask $vport /tmp/vd clip30.mp4 16 | cut -c1-300)"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$vport/metrics').read().decode())" \
      >"$out/vserve_8b_metrics.txt" 2>&1
    nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$out/summary.txt"
  else
    say "8B video: the server did not come up: $(tail -2 "$out/vserve_8b.log" | tr '\n' ' ')"
  fi
  kill -TERM $vpid; wait $vpid
  pack
fi

# NCCL refuses two ranks on one GPU unless each says it is on a host of its own (NCCL_HOSTID); then it talks between
# them over sockets, as between nodes: the code path of two GPUs, not their speed. A launcher word for mpiexec; on a
# machine with a GPU per rank it sets nothing (NCCL then uses NVLink).
hostid=/tmp/nccl_hostid
printf '#!/bin/sh\n[ "$(nvidia-smi -L | wc -l)" -lt "${PMI_SIZE:-1}" ] && export NCCL_HOSTID=q3vl-rank-$PMI_RANK\nexec "$@"\n' \
  >$hostid && chmod +x $hostid
export NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0
# Issue 33: a TP 2 server on CUDA (NCCL sums, then MPI's), rank 1 stopped (SIGSTOP) before a request: /health 503 while
# the step hangs, the open request answered 503, the server exits within runtime.timeout + 5 s naming rank 1.
if part tpstop; then
  for comm in nccl mpi; do
    log=$out/tpstop_$comm.log
    timeout -k 3 90 mpiexec -n 2 $hostid "$q" serve model.preset=tiny model.backend=cuda runtime.share_gpus=true \
      serve.tp_comm=$comm serve.kv_mib=8 runtime.timeout=6 serve.max_tokens=4 serve.port=0 run.timing=false >$log 2>&1 &
    pid=$! port=""
    for _ in $(seq 300); do port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' $log) && break; sleep 0.2; done
    r1=""; for p in $(pgrep -f "q3vl serve"); do tr '\0' '\n' </proc/$p/environ | grep -qx PMI_RANK=1 && r1=$p; done
    kill -STOP $r1; t0=$(date +%s%N)
    hget() {  # hget PATH [BODY]: status and the start of the answer
      python3 -c "
import sys, urllib.request
body = sys.argv[2].encode() if len(sys.argv) > 2 else None
try: r = urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:$port' + sys.argv[1], body, {'Content-Type': 'application/json'}), timeout=30); print(r.status, r.read()[:300].decode())
except urllib.error.HTTPError as e: print(e.code, e.read()[:300].decode())
except Exception as e: print('exception', e)" "$@"
    }
    hget /v1/completions '{"prompt": "hi"}' >$out/tpstop_${comm}_req.txt 2>&1 &
    sleep 4.5
    health=$(hget /health)
    wait $pid; rc=$?; dt=$(( ($(date +%s%N) - t0) / 1000000 ))
    kill -CONT $r1 2>/dev/null; wait
    ok=FAIL
    ((rc != 0 && rc != 124 && dt < 11000)) && [[ $health == 503* ]] && grep -q '^503 .*the server stopped: watchdog' $out/tpstop_${comm}_req.txt &&
      grep -qE "watchdog: collective .* did not complete within runtime.timeout = 6 s.*ranks that did not arrive: 1" $log && ok=PASS
    say "$ok tpstop $comm: exit $rc after $dt ms (bound 11000); /health: $health; request: $(cat $out/tpstop_${comm}_req.txt)"
    grep -m1 "watchdog" $log >>"$out/summary.txt"
    pack
  done
fi
if part nccl; then
  mt=${MPI_TESTS:-/tmp/rt/bin/mpi_tests}
  for n in 2 4; do
    t1=$SECONDS
    Q3VL_REQUIRE_GPU=1 timeout 150 mpiexec -n $n "$mt" --gtest_filter='Nccl*:*DevTp*:*Int8*:*Fp8*' >"$out/mpi_nccl_np$n.log" 2>&1
    say "mpi_tests np$n: rc=$? $((SECONDS - t1)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/mpi_nccl_np$n.log" | sort -u | tr '\n' ' ')"
    grep -E 'dev tp|int8|fp8|FAILED  \]|Failure' "$out/mpi_nccl_np$n.log" | sort -u | head -12 >>"$out/summary.txt"
    pack
  done
fi
part tiny || part nccl || parts+=" skip-tiny"
[[ $parts == *skip-tiny* ]] || {
if part nccl; then
serve_case tiny_gpu_tp2_nccl 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny model.backend=cuda serve.tp_comm=nccl
serve_case tiny-moe_gpu_tp2_nccl 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny-moe model.backend=cuda serve.tp_comm=nccl
serve_case tiny_gpu_tp4_nccl 120 mpiexec -n 4 $hostid "$q" serve model.preset=tiny model.backend=cuda serve.tp_comm=nccl serve.kv_mib=64
serve_case tiny_gpu_pp2tp2_nccl 120 mpiexec -n 4 $hostid "$q" serve model.preset=tiny model.backend=cuda serve.pp=2 serve.tp_comm=nccl serve.kv_mib=64
serve_case tiny_gpu_tp2_nccl_bf16 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny model.backend=cuda model.dtype=bf16 serve.tp_comm=nccl
serve_case tiny-moe_gpu_ep2_nccl 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny-moe model.backend=cuda serve.tp_comm=nccl serve.ep=2
# Decode steps as CUDA graphs holding the NCCL sums (Q3VL_TP_GRAPHS=1): the same answers.
Q3VL_TP_GRAPHS=1 serve_case tiny_gpu_tp2_nccl_graphs 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny model.backend=cuda serve.tp_comm=nccl
Q3VL_TP_GRAPHS=1 serve_case tiny-moe_gpu_ep2_nccl_graphs 120 mpiexec -n 2 $hostid "$q" serve model.preset=tiny-moe model.backend=cuda serve.tp_comm=nccl serve.ep=2
Q3VL_TP_GRAPHS=1 serve_case tiny_gpu_pp2tp2_nccl_graphs 120 mpiexec -n 4 $hostid "$q" serve model.preset=tiny model.backend=cuda serve.pp=2 serve.tp_comm=nccl serve.kv_mib=64
fi
if part tiny; then
serve_case tiny_gpu_1 120 "$q" serve model.preset=tiny model.backend=cuda
serve_case tiny_gpu_tp2 120 mpiexec -n 2 "$q" serve model.preset=tiny model.backend=cuda
serve_case tiny-moe_gpu_1 120 "$q" serve model.preset=tiny-moe model.backend=cuda
serve_case tiny-moe_gpu_tp2 120 mpiexec -n 2 "$q" serve model.preset=tiny-moe model.backend=cuda
serve_case tiny_gpu_bf16 120 "$q" serve model.preset=tiny model.backend=cuda model.dtype=bf16
serve_case tiny_gpu_pp2 120 mpiexec -n 2 "$q" serve model.preset=tiny model.backend=cuda serve.pp=2
serve_case tiny-moe_gpu_pp2 120 mpiexec -n 2 "$q" serve model.preset=tiny-moe model.backend=cuda serve.pp=2
serve_case tiny_gpu_pp2tp2 120 mpiexec -n 4 "$q" serve model.preset=tiny model.backend=cuda serve.pp=2 serve.kv_mib=64
fi
}

# ---- big shapes in bf16 on one H200: random weights streamed to the device -------------------------------------
# big NAME PRESET: serve it, then tools/bench_serve at concurrency 1 and 32 (200 words and a picture, 128 tokens).
big() {
  local name=$1 preset=$2 t0=$SECONDS port="" c
  shift 2  # the rest: the launcher's words before q3vl (e.g. mpiexec -n 2), then -- and extra keys
  (while sleep 2; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >>"$out/smi_$name.txt"; done) &
  local smi=$!
  local pre=() extra=()
  while (($#)) && [[ $1 != -- ]]; do pre+=("$1"); shift; done
  (($#)) && shift && extra=("$@")
  [[ -n ${PROFILE:-} ]] && extra+=(serve.profile_steps=$PROFILE serve.profile_rows=${PROFILE_ROWS:-56})
  timeout 420 "${pre[@]}" "$q" serve model.preset=$preset model.backend=cuda model.dtype=bf16 serve.port=0 \
    serve.max_context=8192 serve.max_batch=64 serve.step_tokens=2048 run.timing=false "${extra[@]}" \
    >"$out/serve_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1500); do
    port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' "$out/serve_$name.log")
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  say "$name: up after $((SECONDS - t0)) s: $(grep -oP 'serve: (on|weights streamed|pipeline) .*|load weights .*' "$out/serve_$name.log" | tr '\n' ' ')"
  pack
  if [[ -n $port ]]; then
    png=$(ls $d/images/*.png | head -1)
    for c in ${CONC:-1 32}; do
      timeout 150 python3 tools/bench_serve --port "$port" -n $((c == 1 ? 8 : 3 * c)) -c $c --prompt-words 200 \
        --image "$png" --max-tokens 128 --label "$name bf16 c=$c" --timeout 120 >>"$out/bench_$name.txt" 2>&1
      pack
    done
    cat "$out/bench_$name.txt" >>"$out/summary.txt"
    kill -TERM $pid; wait $pid
    grep -oP 'serve profile json: \K.*' "$out/serve_$name.log" >"$out/profile_$name.jsonl"
    grep -oP 'serve profile: \K.*' "$out/serve_$name.log" >"$out/profile_$name.txt" &&
      { say "$name: profiled steps (op by op):"; cat "$out/profile_$name.txt" >>"$out/summary.txt"; }
  else
    tail -5 "$out/serve_$name.log" >>"$out/summary.txt"
  fi
  kill $smi
  say "$name: peak memory.used, utilization: $(sort -t, -k1 -n "$out/smi_$name.txt" | tail -1)"
  pack
}
part 8b && big 8b 8B
part 30b && big 30b-a3b 30B-A3B
part 8bnog && big 8b-nograph 8B -- model.cuda_graphs=false
part 8bnovb && big 8b-novisionbatch 8B -- serve.vision_batch=false
part 30bnog && big 30b-a3b-nograph 30B-A3B -- model.cuda_graphs=false
part 8bpp && big 8b-pp2 8B mpiexec -n 2 -- serve.pp=2
part 8bint8 && big 8b-int8 8B -- model.weight_dtype=int8
part 30bint8 && big 30b-a3b-int8 30B-A3B -- model.weight_dtype=int8
part 8bfp8 && big 8b-fp8 8B -- model.weight_dtype=fp8
part 8btpot && big 8b-tpot14 8B -- serve.max_tpot_ms=14
part 30bfp8 && big 30b-a3b-fp8 30B-A3B -- model.weight_dtype=fp8
part 8btp2 && big 8b-tp2-nccl 8B mpiexec -n 2 $hostid -- serve.tp_comm=nccl
part 8btp2 && big 8b-tp2-mpi 8B mpiexec -n 2 -- serve.tp_comm=mpi
part 8btp2g && Q3VL_TP_GRAPHS=1 big 8b-tp2-nccl-graphs 8B mpiexec -n 2 $hostid -- serve.tp_comm=nccl
part 30btp2 && big 30b-a3b-tp2-nccl 30B-A3B mpiexec -n 2 $hostid -- serve.tp_comm=nccl
part 30bpp && big 30b-a3b-pp2 30B-A3B mpiexec -n 2 -- serve.pp=2
part 30btp4 && big 30b-a3b-tp4-nccl 30B-A3B mpiexec -n 4 $hostid -- serve.tp_comm=nccl
part 30bep2 && big 30b-a3b-ep2-nccl 30B-A3B mpiexec -n 2 $hostid -- serve.tp_comm=nccl serve.ep=2
part 30bep4 && big 30b-a3b-ep4-nccl 30B-A3B mpiexec -n 4 $hostid -- serve.tp_comm=nccl serve.ep=4
part 30bep8 && big 30b-a3b-ep8-nccl 30B-A3B mpiexec -n 8 $hostid -- serve.tp_comm=nccl serve.ep=8
part 30bauto && big 30b-a3b-auto2 30B-A3B mpiexec -n 2 --
if part hfbase; then
  t1=$SECONDS
  timeout 300 python3 tools/gpu/hf_serve_baseline.py --preset 8B --batch 32 >"$out/hfbase.txt" 2>"$out/hfbase.err"
  say "hfbase: rc=$? $((SECONDS - t1)) s"
  cat "$out/hfbase.txt" >>"$out/summary.txt"
  tail -3 "$out/hfbase.err" >>"$out/summary.txt"
  pack
fi
