#!/usr/bin/env bash
# Issue 35's runs on 2, 4 and 8 GPUs of one host (nvidia-h200-x2, -x4, -x8), each beside its PyTorch baseline in the
# same call, from the repo root with the packed runtime sourced (bin/q3vl and bin/unit_tests packed by pack-runtime):
#   tools/gpu/multi_checks.sh Q3VL UNIT_TESTS OUTDIR PARTS
# One rank a GPU (mpiexec -n N; the ranks find their GPUs by local rank). A device call is 600 s, so a call runs a
# few parts; their costs below are estimates (start-up included) to plan calls with.
# Parts (N: the GPUs a part needs at least):
# - train8b (2, ~300 s): the 8B shape (input/bench_8b_gpu.deck: 4 x 4096 tokens a GPU a micro-step, one image a
#   sequence, bf16, ZeRO-3, block recomputation) on 1 GPU with the optimizer offloaded (the only way 8.8 B parameters'
#   state fits one H200), on 2 GPUs, and on 2 GPUs offloaded: tokens/s per GPU (median of steps 3..), the 2-GPU runs
#   against 1 GPU's (issue 35: >= 95% with offload on both sides), step 3's profile with its exposed communication.
# - fsdp8b (2, ~400 s): torch FSDP2 on the same 2 GPUs and shape (tools/gpu/fsdp_train_baseline.py --checkpointing),
#   without and with CPUOffloadPolicy; the ratios against train8b's runs (issue 35: q3vl >= 1.5x FSDP2).
# - train2b (2, ~250 s): the 2B shape (input/bench_2b_gpu.deck) on 1 and 2 GPUs at ZeRO-3 and FSDP2 on 2 (FSDP2 did
#   19.7k tokens/s per GPU on 2026-11-30): the scaling at a shape that fits one GPU.
# - hang (2, ~60 s): a planted hang: rank 1 stops itself (SIGSTOP) before a forward collective of step 3 on 2 GPUs;
#   PASS when the job exits within runtime.timeout (20 s) + 20 s, naming the collective and rank 1.
# - ep2 (2, ~350 s): the 30B-A3B shapes cut to 6 decoder layers (input/bench_30b_a3b_gpu.deck, 1 x 4096 tokens a
#   GPU) at EP 1 on 1 GPU, EP 1 and EP 2 on 2 GPUs (tokens/s per GPU, the all-to-all rows of step 3's profile), and
#   FSDP2 on the 2 GPUs.
# - serve2 (2, ~600 s): tools/gpu/serve_checks.sh's 8B and 30B-A3B servers (bf16, issue 32's request mix) on 1 GPU, at
#   serve.tp = 2 over NCCL (the 8B also with Q3VL_TP_GRAPHS=1: decode steps as graphs holding the NCCL sums, the A/B
#   that decides its default) and at serve.pp = 2, 1 and 64 streams (CONC); its results under OUTDIR/serve/.
# - serveep2 (2, ~200 s): the 30B-A3B at serve.tp = serve.ep = 2 (64 whole experts per rank), against serve2's TP 2.
# - layout (2, ~250 s): the seed's claim of an automatic serving layout (18 against 12 tok/s, 89% memory): `q3vl plan
#   plan.for=serve` on this machine, then the 30B-A3B served at the automatic layout (serve.tp = serve.pp = 0) and at
#   the other one of the two GPUs (tp 2 or pp 2): tok/s at 1 and 64 streams and the peak memory used.
# - scale (4 or 8, ~150 s a rank count): the training scaling table: the 8B shape at ZeRO-3 on 2, 4 and 8 GPUs (what the
#   machine has) and FSDP2 at the same counts; the 30B-A3B cut at EP = the GPUs; tokens/s per GPU. The 1-GPU rows are
#   train8b's and ep2's.
# - serve4 (4, ~550 s): the 30B-A3B served at serve.tp = 4 (every expert's rows split) and at serve.tp = serve.ep = 4
#   (whole experts per rank), 1 and 64 streams.
# - serve8 (8, ~300 s): the 30B-A3B served at serve.tp = serve.ep = 8 (16 whole experts per rank), 1 and 64 streams.
# - big235 (8, ~500 s): the 235B-A22B shape cut to K235 decoder layers (default 8; `q3vl plan` fits 12 at 124 GiB a
#   GPU): `q3vl plan` on this machine (its MemTotal), then the plan's layout trained for 5 steps on synthetic 8192-token
#   samples: the measured step time against the plan's prediction, and memory.
# - hybrid (4, ~200 s): the 2B shape on 4 GPUs, hybrid sharding over two "nodes" of 2 (MPICH's MPIR_CVAR_NUM_CLIQUES=2
#   makes the shared-memory split see two nodes) against flat ZeRO-3 on the same 4 GPUs.
# Everything lands in OUTDIR/results.tgz, refreshed after every run, so that a call cut short returns what finished.
set -u
q=$1 ut=$2 final=$3 parts=${4:-} out=/tmp/multi_results  # serve_checks.sh writes /tmp/results
part() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out" "$final"
pack() { tar czf "$final/results.tgz" -C "$out" . && cp "$out/summary.txt" "$final/"; }
say() { echo "$*" >>"$out/summary.txt"; }
export OPENBLAS_NUM_THREADS=1 NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L >>"$out/summary.txt"
say "multi_checks: $ngpu GPU(s), parts: $parts"
need() {  # need PART N: true when the machine has N GPUs, else a line saying the part did not run
  ((ngpu >= $2)) && return 0
  say "SKIPPED $1: needs $2 GPUs, this machine has $ngpu"; pack; return 1
}
py() { env -u LD_LIBRARY_PATH python3 "$@"; }  # the system's Python (torch) without the packed MPICH/HDF5 libraries

# qtrain NAME NP TIMEOUT DECK ARGS...: q3vl train on NP ranks, step 3 profiled; its log, metrics and profile table.
# QWRAP: a launcher word between mpiexec and q3vl.
qtrain() {
  local n=$1 np=$2 t=$3 deck=$4 t1=$SECONDS; shift 4
  rm -rf /tmp/runs/$n
  (while sleep 2; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1; done \
    >"$out/${n}_mem.txt") &
  local smi=$!
  timeout "$t" mpiexec -n "$np" ${QWRAP:-} "$q" train "$deck" checkpoint.every=0 train.resume=never run.profile=true \
    run.profile_step=3 run.profile_top=40 run.out_dir=/tmp/runs/$n "$@" >"$out/$n.log" 2>&1
  local rc=$?
  kill $smi 2>/dev/null
  cp /tmp/runs/$n/metrics.jsonl "$out/$n.jsonl" 2>/dev/null
  sed -n '/^profile of step/,/compute stream busy/p' "$out/$n.log" >"$out/${n}_profile.txt"
  say "$n: rc=$rc $((SECONDS - t1)) s on $np GPU(s); $(per_gpu "$out/$n.jsonl" "$np"); peak memory.used" \
      "$(sort -n "$out/${n}_mem.txt" | tail -1) MiB; $(grep -m1 -oE 'exposed communication [^;]*' "$out/${n}_profile.txt")"
  grep -m1 "memory per rank" "$out/$n.log" >>"$out/summary.txt"
  rm -rf /tmp/runs/$n
  pack
}
# fsdp NAME NP TIMEOUT ARGS...: tools/gpu/fsdp_train_baseline.py under torchrun on NP GPUs.
fsdp() {
  local n=$1 np=$2 t=$3 t1=$SECONDS; shift 3
  env -u LD_LIBRARY_PATH timeout "$t" python3 -m torch.distributed.run --standalone --nproc-per-node "$np" \
    tools/gpu/fsdp_train_baseline.py --out "$out/$n.jsonl" "$@" >"$out/$n.log" 2>&1
  say "$n: rc=$? $((SECONDS - t1)) s: $(tail -1 "$out/$n.log" | cut -c1-600)"
  pack
}
# per_gpu FILE NP: median tokens/s a GPU over steps 3.. of a metrics file (q3vl's tokens_per_s is the job's; FSDP's
# file says tokens_per_s per GPU and gpus).
per_gpu() {
  py - "$1" "$2" <<'PY' 2>&1
import json, statistics, sys
try:
    r = [json.loads(l) for l in open(sys.argv[1]) if "tokens_per_s" in l][2:]
    np = int(sys.argv[2])
    tps = statistics.median(x["tokens_per_s"] / (1 if "gpus" in x else np) for x in r)
    mfu = statistics.median(x.get("mfu", 0) for x in r)
    print(f"{tps:.0f} tokens/s per GPU (mfu {mfu:.3f}, steps 3-{len(r) + 2})")
except Exception as e:
    print(f"no steps to count ({type(e).__name__})")
PY
}
# vs A NPA B NPB LABEL [BOUND]: per-GPU tokens/s of run A over run B's; PASS/FAIL against BOUND when given.
vs() {
  py - "$out/$1.jsonl" "$2" "$out/$3.jsonl" "$4" "$5" "${6:-}" <<'PY' >>"$out/summary.txt" 2>&1
import json, statistics, sys
def tps(f, np):
    r = [json.loads(l) for l in open(f) if "tokens_per_s" in l][2:]
    return statistics.median(x["tokens_per_s"] / (1 if "gpus" in x else np) for x in r)
a, na, b, nb, label, bound = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
try:
    ra = tps(a, na) / tps(b, nb)
except Exception as e:
    print(f"FAIL {label}: no ratio ({type(e).__name__}: {e})"); sys.exit()
verdict = "" if not bound else ("PASS " if ra >= float(bound) else "FAIL ")
print(f"{verdict}{label}: {ra:.3f}" + (f" (bound {bound})" if bound else ""))
PY
  pack
}
b8="input/bench_8b_gpu.deck"
b2="input/bench_2b_gpu.deck"
b30="input/bench_30b_a3b_gpu.deck"
off="parallel.offload_optimizer=cpu"

if part train8b && need train8b 2; then
  qtrain q8b_1off 1 200 $b8 train.global_batch=4 $off
  qtrain q8b_2 2 150 $b8 train.global_batch=8
  qtrain q8b_2off 2 200 $b8 train.global_batch=8 $off
  vs q8b_2off 2 q8b_1off 1 "8B ZeRO-3 with offload, per GPU: 2 GPUs / 1 GPU" 0.95
  vs q8b_2 2 q8b_1off 1 "8B ZeRO-3 per GPU: 2 GPUs (no offload) / 1 GPU (offload: it fits no other way)"
fi
if part fsdp8b && need fsdp8b 2; then
  fsdp fsdp8b_2 2 250 --preset 8B --batch 4 --seq 4096 --checkpointing
  fsdp fsdp8b_2off 2 300 --preset 8B --batch 4 --seq 4096 --checkpointing --offload --steps 5
  [[ -f $out/q8b_2.jsonl ]] && vs q8b_2 2 fsdp8b_2 2 "8B on 2 GPUs, q3vl ZeRO-3 / FSDP2" 1.5
  [[ -f $out/q8b_2off.jsonl ]] && vs q8b_2off 2 fsdp8b_2off 2 "8B on 2 GPUs with offload, q3vl / FSDP2 CPUOffloadPolicy"
fi
if part train2b && need train2b 2; then
  qtrain q2b_1 1 120 $b2
  qtrain q2b_2 2 120 $b2 train.global_batch=8
  fsdp fsdp2b_2 2 200 --preset 2B --batch 4 --seq 4096
  vs q2b_2 2 q2b_1 1 "2B ZeRO-3 per GPU: 2 GPUs / 1 GPU" 0.95
  vs q2b_2 2 fsdp2b_2 2 "2B on 2 GPUs, q3vl ZeRO-3 / FSDP2" 1.5
fi

if part hang && need hang 2; then
  t1=$SECONDS
  timeout 120 mpiexec -n 2 "$q" train $b2 train.global_batch=8 checkpoint.every=0 train.resume=never \
    run.out_dir=/tmp/runs/hang runtime.timeout=20 runtime.debug_stop_rank=1 runtime.debug_stop_step=3 \
    runtime.debug_stop_phase=forward >"$out/hang.log" 2>&1
  rc=$? dt=$((SECONDS - t1)) ok=FAIL
  line=$(grep -m1 -E "watchdog: collective .* did not complete within runtime.timeout" "$out/hang.log")
  ((rc != 0 && rc != 124 && dt < 120)) && [[ $line == *"ranks that did not arrive: 1"* ]] && ok=PASS
  say "$ok hang: exit $rc after $dt s (runtime.timeout = 20; start-up and 2 steps before it): ${line:-no watchdog line}"
  pkill -CONT -f "q3vl train" 2>/dev/null; pkill -f "q3vl train" 2>/dev/null
  rm -rf /tmp/runs/hang; pack
fi

if part ep2 && need ep2 2; then
  qtrain q30_1 1 150 $b30
  qtrain q30_ep1_2 2 150 $b30 train.global_batch=2
  qtrain q30_ep2_2 2 150 $b30 train.global_batch=2 parallel.ep=2
  grep -hE "^  (host waits: |)(nccl |mpi |)all_to_all" "$out"/q30_ep2_2_profile.txt | head -4 >>"$out/summary.txt"
  fsdp fsdp30_2 2 250 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  vs q30_ep2_2 2 q30_ep1_2 2 "30B-A3B x 6 layers on 2 GPUs per GPU: EP 2 / EP 1"
  vs q30_ep2_2 2 q30_1 1 "30B-A3B x 6 layers per GPU: EP 2 on 2 GPUs / 1 GPU"
  vs q30_ep2_2 2 fsdp30_2 2 "30B-A3B x 6 layers on 2 GPUs, q3vl EP 2 / FSDP2"
fi

# serve_parts PARTS: serve_checks.sh's parts on this machine, results under OUTDIR/serve (its summary appended here).
serve_parts() {
  local t1=$SECONDS
  CONC=${CONC:-1 64} bash tools/gpu/serve_checks.sh "$q" "$ut" "$final/serve" "$1" >"$out/serve_checks.log" 2>&1
  say "serve_checks '$1': rc=$? $((SECONDS - t1)) s"
  cat "$final/serve/summary.txt" >>"$out/summary.txt" 2>/dev/null
  pack
}
part serve2 && need serve2 2 && serve_parts "8b 8btp2 8btp2g 8bpp 30b 30btp2 30bpp"
part serveep2 && need serveep2 2 && serve_parts "30bep2"
part serve4 && need serve4 4 && serve_parts "30btp4 30bep4"
part serve8 && need serve8 8 && serve_parts "30bep8"

if part layout && need layout 2; then
  host=$(awk '/MemTotal/ {printf "%dGiB", $2 / 1048576}' /proc/meminfo)
  "$q" plan model.preset=30B-A3B model.dtype=bf16 plan.for=serve plan.gpus_per_node=2 plan.host_mem=$host \
    >"$out/layout_plan.txt" 2>&1
  say "layout: q3vl plan plan.for=serve on 2 GPUs:"; sed -n '/^serve layouts/,$p' "$out/layout_plan.txt" >>"$out/summary.txt"
  serve_parts "30bauto 30bpp"
fi

if part scale && need scale 4; then
  for n in 2 4 8; do
    ((n <= ngpu)) || continue
    qtrain q8b_$n $n 200 $b8 train.global_batch=$((4 * n))
    fsdp fsdp8b_$n $n 300 --preset 8B --batch 4 --seq 4096 --checkpointing
    vs q8b_$n $n fsdp8b_$n $n "8B on $n GPUs, q3vl ZeRO-3 / FSDP2"
    qtrain q30_ep${n}_$n $n 200 $b30 train.global_batch=$n parallel.ep=$n
  done
  py - "$out" <<'PY' >>"$out/summary.txt" 2>&1
import json, os, statistics, sys
d = sys.argv[1]
def tps(name, np):
    try:
        r = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl")) if "tokens_per_s" in l][2:]
        return f"{statistics.median(x['tokens_per_s'] / (1 if 'gpus' in x else np) for x in r):.0f}"
    except OSError:
        return "-"
print("scaling, tokens/s per GPU | GPUs: 1 2 4 8")
print("  q3vl 8B ZeRO-3 (1 GPU: offload) |", tps("q8b_1off", 1), *(tps(f"q8b_{n}", n) for n in (2, 4, 8)))
print("  FSDP2 8B |", "-", *(tps(f"fsdp8b_{n}", n) for n in (2, 4, 8)))
print("  q3vl 30B-A3B x 6, EP = GPUs |", tps("q30_1", 1), *(tps(f"q30_ep{n}_{n}", n) for n in (2, 4, 8)))
PY
  pack
fi

if part big235 && need big235 8; then
  k=${K235:-8}
  host=$(awk '/MemTotal/ {printf "%dGiB", $2 / 1048576}' /proc/meminfo)
  cut="model.hf= model.preset=235B-A22B model.text_layers=$k train.global_batch=8"
  "$q" plan input/qwen3vl_235b.deck $cut plan.gpus_per_node=8 plan.host_mem=$host >"$out/big235_plan.txt" 2>&1
  # The plan's deck lines as key=value words: [section] then key = value (quotes dropped); no offload unless it says.
  layout=$(awk '/^deck lines:/ {on = 1; next} on && /^$/ {exit} on && /^\[/ {s = substr($0, 2, length($0) - 2); next}
                on && / = / {gsub(/"/, "", $3); printf "%s.%s=%s ", s, $1, $3}' "$out/big235_plan.txt")
  [[ $layout == *offload_optimizer* ]] || layout+=" parallel.offload_optimizer=none"
  say "big235: 235B-A22B x $k layers, plan on 8 GPUs and $host: $(grep -A1 -m1 '^fastest' "$out/big235_plan.txt" | tail -1)"
  say "big235: layout $layout"
  grep -q '^fastest that fits' "$out/big235_plan.txt" || { say "FAIL big235: the plan fits nothing"; pack; parts=${parts/big235/}; }
fi
if part big235 && ((ngpu >= 8)); then
  qtrain big235 8 480 input/qwen3vl_235b.deck $cut $layout train.dataset=synthetic train.synthetic_samples=256 \
    train.synthetic_len=8192 train.synthetic_image_px=448 train.synthetic_image_every=1 train.max_patches=8192 \
    train.steps=5 runtime.timeout=300
  py - "$out/big235.jsonl" "$out/big235_plan.txt" <<'PY' >>"$out/summary.txt" 2>&1
import json, re, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1]) if "tokens_per_s" in l][2:]
got = statistics.median(x["time"]["step"] for x in r)
m = re.search(r"step ([0-9.]+) s", open(sys.argv[2]).read().split("fastest that fits", 1)[1])
want = float(m.group(1))
print(f"big235: measured step {got:.2f} s (median of steps 3-{len(r) + 2}) against the plan's {want:.2f} s: "
      f"{got / want:.2f}x")
PY
  pack
fi

if part hybrid && need hybrid 4; then
  qtrain q2b_flat4 4 150 $b2 train.global_batch=16
  # Two "nodes" number their ranks 0, 1 each, and a rank takes the GPU of its node rank: each rank gets one GPU of
  # its own (its global rank) through CUDA_VISIBLE_DEVICES instead.
  printf '#!/bin/sh\nexport CUDA_VISIBLE_DEVICES=${PMI_RANK:-0}\nexec "$@"\n' >/tmp/onegpu && chmod +x /tmp/onegpu
  MPIR_CVAR_NUM_CLIQUES=2 QWRAP=/tmp/onegpu qtrain q2b_hyb4 4 150 $b2 train.global_batch=16 parallel.hybrid=true
  grep -m1 -iE "hybrid|replica" "$out/q2b_hyb4.log" >>"$out/summary.txt"
  vs q2b_hyb4 4 q2b_flat4 4 "2B on 4 GPUs, hybrid (2 x 2) / flat ZeRO-3"
fi
say "multi_checks done"
pack
