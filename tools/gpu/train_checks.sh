#!/usr/bin/env bash
# Issue 28's GPU checks (training over GPU ranks, ZeRO on device buffers through NCCL) in one call on the GPU machine,
# from the repo root with the packed runtime sourced:
#   tools/gpu/train_checks.sh Q3VL UNIT_TESTS OUTDIR [PARTS]
#   PARTS (default all): goldens unit lora zero ep bf16 resume stop bench offload delayed video hftrain profile big
#   ring hostbase partial moe overlap inbwd (BIG="235b": part big's 235B cut alone)
# - goldens: tools/make_lora_goldens.py (transformers + peft, fp32 on the CPU) into tests/data/golden/*/lora here and
#   into OUTDIR's results (to commit);
# - unit: the device-model suites, LoRA's included (against those goldens), with Q3VL_REQUIRE_GPU=1;
# - lora: the demo model with adapters on every kind of linear and the LM head, 20 steps in fp32 on 1, 2 and 4 GPU
#   ranks: every step's loss against 1 GPU rank's (1e-5); with dropout 0.1, 2 GPU ranks against 2 CPU ranks;
# - zero: the demo model, 20 steps in fp32 on 1 GPU rank, then 2 and 4 ranks sharing the GPU through NCCL
#   (NCCL_HOSTID per rank) at ZeRO-3, 2 ranks at stages 1 and 2, 4 ranks hybrid (two MPICH "nodes" of 2): every
#   step's loss against 1 rank's (1e-5);
# - ep: the golden MoE model (4 experts, top-2, aux loss) in fp32: EP 2 on 2 and 4 GPU ranks and EP 4 on 4 (rows over
#   NCCL on the model's stream, expert units over their replicas), every step's loss against EP 1 on 1 rank (1e-5);
# - bf16: 1 and 2 ranks in bf16 against fp32 (2%);
# - resume: 4 GPU ranks stop at step 10; the checkpoint resumes on 1 GPU rank and on 2 CPU ranks, the curves against
#   the straight run;
# - stop: one of 2 GPU ranks stops itself (SIGSTOP) before a collective: the job ends within runtime.timeout,
#   naming the collective and the rank;
# - bench: the 2B shape (input/bench_2b_gpu.deck) on one H200 at ZeRO-3 and ZeRO-1: tokens/s, MFU, device memory.
# - offload (issue 29): the optimizer offloaded to the host (parallel.offload_optimizer = cpu; the CPU op layer's
#   AdamW on the host, the GPU's in the other runs: fp32 rounding apart) on the demo model, 20 steps in fp32 on 1 rank
#   and 2 ranks sharing the GPU, every step's loss against the same run on the GPU's optimizer (1e-5); fp16 with
#   dynamic loss scaling started at 2^32 so that the first steps overflow: the same steps skipped, the same scales,
#   losses within 1e-3; the frozen base on the host (offload_params = frozen) with LoRA against LoRA on the GPU
#   (1e-5). (The 2B shape's step times with and without offload: part delayed.)
# - video (issue 31): tools/make_video_goldens.py (transformers' Qwen3VLVideoProcessor and the model on videos, fp32
#   on the CPU) into tests/data here and into OUTDIR's results (to commit), then the processor and video golden suites
#   (the CPU op layer and CUDA) against them.
# - hftrain (issue 30): the 2B shape in q3vl (ZeRO-3, one rank) and in transformers (tools/gpu/hf_train_baseline.py:
#   4 x 4096 tokens, one 448 px image a sequence, bf16 autocast, SDPA, fused AdamW) side by side: median tokens/s
#   over steps 3-8 and their ratio.
# - moe (issue 30): the 30B-A3B shapes cut to 6 decoder layers (input/bench_30b_a3b_gpu.deck: 1 x 4096 tokens, one
#   448 px image) in q3vl and in transformers (hf_train_baseline.py --preset 30B-A3B --text-layers 6 --batch 1 --seq
#   4096) side by side: median tokens/s over steps 3-8, their ratio and both MFUs on active parameters.
# - profile (issue 30): the 2B shape (input/bench_2b_gpu.deck) with run.profile = true for 4 steps: step 3's table
#   (CUDA events) in profile.log, every profiled step's "profile" object in profile.jsonl, and the rows of step 3
#   whose share of the step is largest in the summary, with the phases and the compute stream's idle time.
# - big (issue 29): `q3vl check` on CUDA (the host AdamW and pinned copy rates), then `q3vl plan` with those rates and
#   this host's MemTotal, and the runs it sizes: the 8B shape's full fine-tuning with the optimizer offloaded
#   (input/bench_8b_offload.deck: delayed update, 4 micro-steps of 4 x 4096 tokens) and the 235B LoRA deck cut to 4
#   decoder layers with its frozen base on the host (offload_params = frozen), each with its measured GPU and host
#   memory (device total - free after start-up; peak RSS) and step time beside the plan's.
# - hostbase (issue 29): LoRA with the frozen base on the host (fp32: streamed from the masters; bf16: from a pinned
#   bf16 copy, the fp32 masters released) against the base on the device, fp32 and bf16, 1 and 2 ranks (1e-5).
# - ring (issue 29): the 2B shape offloaded, synchronous and delayed, at ring chunks of 1M and 4M elements
#   (parallel.offload_chunk, two slots per host thread): the step and its optimizer phase (the host update).
# - partial (issue 29): partial offload (parallel.offload_ratio): the demo model in fp32, 20 steps, ratio 0.5 against
#   the GPU's optimizer at 1 and 2 ranks, and delayed at 2 ranks against 1; then the 2B shape side by side in one call:
#   the GPU's optimizer, and the delayed update with the host's part at RATIOS (default "0.7 0.5"): step and ratio.
# - overlap (issue 30): the optimizer update overlapped with the next forward (DevZero::update_runs,
#   Q3VL_OVERLAP_UPDATE=1) against the same run with Q3VL_OVERLAP_UPDATE=0 (the update on the model's stream, then
#   the forward): the same kernels on the same data, so every step's loss must be equal (bound 0), and two runs
#   without the overlap must be (the bound's premise: the training is deterministic). The demo model, 20 steps, in
#   bf16 on 1 rank and in fp32 on 2 ranks sharing the GPU (ZeRO-3 over NCCL: the gathers wait for the update on the
#   communication stream); then a checkpoint at step 10 resumed on 1 rank against the straight run (1e-6).
# - inbwd (issue 30): optim.update_in_backward (each unit's AdamW on the update's stream as the last backward
#   completes its gradient shard) against the update after the norm, both with optim.clip = 0: the same kernels on
#   the same gradients, so every step's loss must be equal (bound 0); the demo model, 20 steps, bf16 on 1 rank (the
#   stream at the model's priority, and below it: Q3VL_UPDATE_PRIO=low) and fp32 on 2 ranks sharing the GPU (the
#   units' reduce-scatters on the communication stream before their updates), with 2 micro-steps a step; then
#   train.debug_nan_step=3: one unit skipped, named, the run going on; then the MoE golden model (its units' checks
#   adding the squares the grouped GEMM took): equal.
# Everything lands in OUTDIR/results.tgz, refreshed after every part, so that a call cut short returns what finished.
set -u
q=$1 ut=$2 final=$3 out=/tmp/results
parts=${4:-goldens unit lora zero ep bf16 resume stop bench offload delayed video hftrain profile big}
part() { [[ " $parts " == *" $1 "* ]]; }
mkdir -p "$out" "$final"
pack() { tar czf "$final/results.tgz" -C "$out" . && cp "$out/summary.txt" "$final/"; }
say() { echo "$*" >>"$out/summary.txt"; }
export OPENBLAS_NUM_THREADS=1 NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0
nvidia-smi -L >"$out/summary.txt"
# NCCL refuses two ranks on one GPU unless each says it is on a host of its own (NCCL_HOSTID): the code path of
# several GPUs, not their speed. On a machine with a GPU per rank the launcher sets nothing.
hostid=/tmp/nccl_hostid
printf '#!/bin/sh\n[ "$(nvidia-smi -L | wc -l)" -lt "${PMI_SIZE:-1}" ] && export NCCL_HOSTID=q3vl-rank-$PMI_RANK\nexec "$@"\n' \
  >$hostid && chmod +x $hostid
demo="input/demo.deck train.dataset=synthetic train.synthetic_samples=2000 train.steps=20 checkpoint.every=0
      run.timing=false runtime.timeout=60"
gpu="model.backend=cuda runtime.share_gpus=true"
run() {  # run NAME NP TIMEOUT ARGS...: one training run, its log and metrics
  local name=$1 np=$2 t=$3; shift 3
  local t0=$SECONDS
  timeout "$t" mpiexec -n "$np" $hostid "$q" train $demo run.out_dir=/tmp/runs/$name "$@" >"$out/$name.log" 2>&1
  say "$name: rc=$? $((SECONDS - t0)) s"
  cp /tmp/runs/$name/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
  pack
}
cmp() {  # cmp NAME REF TOL: every step's loss within TOL (relative) of the reference run's
  python3 - "$out/$1.jsonl" "$out/$2.jsonl" "$3" "$1 vs $2" >>"$out/summary.txt" 2>&1 <<'PY'
import json, sys
a, b = ({json.loads(l)["step"]: json.loads(l)["loss"] for l in open(f)} for f in sys.argv[1:3])
tol, what = float(sys.argv[3]), sys.argv[4]
common = sorted(set(a) & set(b))
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in common) if common else float("nan")
ok = bool(common) and worst == worst and worst <= tol
print(f"{'PASS' if ok else 'FAIL'} {what}: {len(common)} steps, worst relative loss difference {worst:.2e} (bound {tol:g})")
PY
  pack
}

if part goldens; then
  t0=$SECONDS
  timeout 300 python3 tools/make_lora_goldens.py /tmp/lora_goldens >"$out/goldens.log" 2>&1
  say "goldens: rc=$? $((SECONDS - t0)) s: $(grep -c 'target patterns' "$out/goldens.log") cases"
  for c in /tmp/lora_goldens/*/; do rm -rf "tests/data/golden/$(basename "$c")/lora" && cp -r "$c" "tests/data/golden/$(basename "$c")/lora"; done
  cp -r /tmp/lora_goldens "$out/lora_goldens"
  pack
fi

if part unit; then
  t0=$SECONDS
  Q3VL_REQUIRE_GPU=1 timeout 200 "$ut" --gtest_filter='DevLayers.*:DevVision.*:DevModel.*:Golden.*:Lora.*:BackendOps.*:Profile.*' \
    >"$out/unit.log" 2>&1
  say "unit: rc=$? $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/unit.log" | tr '\n' ' ')"
  pack
fi

if part lora; then
  # The rank count changes which rows share a micro-batch and so the dropout draws: 1 = 2 = 4 ranks without dropout;
  # with it, 2 GPU ranks against 2 CPU ranks (the same masks on both devices).
  lora="lora.rank=8 lora.alpha=16
        lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,attn.proj,linear_fc1,linear_fc2,lm_head"
  run lora_1 1 120 $gpu $lora
  for n in 2 4; do run lora_$n $n 100 $gpu $lora && cmp lora_$n lora_1 1e-5; done
  run lora_drop_2 2 100 $gpu $lora lora.dropout=0.1 train.steps=4
  run lora_drop_cpu2 2 200 $lora lora.dropout=0.1 train.steps=4 && cmp lora_drop_cpu2 lora_drop_2 1e-5
  grep -h "lora: rank\|memory per rank" "$out"/lora_1.log >>"$out/summary.txt"
  pack
fi

if part zero; then
  run z3_1 1 120 $gpu
  for n in 2 4; do run z3_$n $n 100 $gpu && cmp z3_$n z3_1 1e-5; done
  for st in 1 2; do run z${st}_2 2 100 $gpu parallel.zero_stage=$st && cmp z${st}_2 z3_1 1e-5; done
  MPIR_CVAR_NUM_CLIQUES=2 run hybrid_4 4 100 $gpu parallel.hybrid=true && cmp hybrid_4 z3_1 1e-5
  grep -h "memory per rank" "$out"/z3_1.log "$out"/z3_2.log "$out"/z1_2.log | head -3 >>"$out/summary.txt"
  pack
fi

if part ep; then
  # The aux loss pools its expert fractions and probabilities over each micro-batch (as transformers does per batch),
  # so it changes with how the rank count groups the rows: EP is compared at the same rank count, and EP 1 across
  # rank counts is reported beside it (a few 1e-5).
  moe="model.hf=tests/data/golden/moe/model train.router_aux_loss=true train.steps=10"
  run ep1_1 1 120 $gpu $moe
  for n in 2 4; do
    run ep1_$n $n 100 $gpu $moe && cmp ep1_$n ep1_1 1e-5
    run ep${n}_$n $n 100 $gpu $moe parallel.ep=$n && cmp ep${n}_$n ep1_$n 1e-5
  done
  grep -h "memory per rank" "$out"/ep2_2.log | head -1 >>"$out/summary.txt"
  pack
fi

if part bf16; then
  [[ -f $out/z3_1.jsonl ]] || run z3_1 1 120 $gpu
  run bf16_1 1 120 $gpu model.dtype=bf16 && cmp bf16_1 z3_1 2e-2
  run bf16_2 2 100 $gpu model.dtype=bf16 && cmp bf16_2 z3_1 2e-2 && cmp bf16_2 bf16_1 2e-2
fi

if part resume; then
  [[ -f $out/z3_1.jsonl ]] || run z3_1 1 120 $gpu
  run half_4 4 100 $gpu train.stop_after=10 checkpoint.every=10
  rm -rf /tmp/runs/resume_gpu1 /tmp/runs/resume_cpu2
  cp -r /tmp/runs/half_4 /tmp/runs/resume_gpu1 && cp -r /tmp/runs/half_4 /tmp/runs/resume_cpu2
  run resume_gpu1 1 120 $gpu train.resume=auto && cmp resume_gpu1 z3_1 1e-5
  run resume_cpu2 2 200 train.resume=auto && cmp resume_cpu2 z3_1 1e-5
  grep -h "resumed from" "$out"/resume_*.log >>"$out/summary.txt"
  pack
fi

if part stop; then
  t0=$SECONDS
  timeout 120 mpiexec -n 2 $hostid "$q" train $demo run.out_dir=/tmp/runs/stop $gpu runtime.timeout=15 \
    runtime.debug_stop_rank=1 runtime.debug_stop_step=3 runtime.debug_stop_phase=forward >"$out/stop.log" 2>&1
  say "stop: rc=$? after $((SECONDS - t0)) s (runtime.timeout = 15): $(grep -m1 -E 'did not|timed out|timeout' "$out/stop.log")"
  pack
fi

if part bench; then
  for st in 3 1; do
    rm -rf /tmp/runs/bench$st
    (while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done >"$out/bench${st}_mem.txt") &
    mem=$!
    ("$q" train input/bench_2b_gpu.deck parallel.zero_stage=$st run.out_dir=/tmp/runs/bench$st >"$out/bench$st.log" 2>&1) &
    b=$!
    for _ in $(seq 120); do
      sleep 1
      [[ -f /tmp/runs/bench$st/metrics.jsonl ]] && (($(wc -l </tmp/runs/bench$st/metrics.jsonl) >= 8)) && break
      kill -0 $b 2>/dev/null || break
    done
    kill $b 2>/dev/null; pkill -f bench_2b_gpu; kill $mem; wait $b 2>/dev/null
    cp /tmp/runs/bench$st/metrics.jsonl "$out/bench$st.jsonl" 2>/dev/null
    say "bench stage $st: max GPU memory used $(sort -n "$out/bench${st}_mem.txt" | tail -1) MiB; $(python3 -c "
import json,sys
l=[json.loads(x) for x in open('$out/bench$st.jsonl')]
print(f'{len(l)} steps, last: {l[-1][\"tokens_per_s\"]:.0f} tok/s, mfu {l[-1][\"mfu\"]:.3f}, step {l[-1][\"time\"][\"step\"]:.3f} s')
" 2>&1)"
    grep -m1 "memory per rank" "$out/bench$st.log" >>"$out/summary.txt"
    pack
  done
fi

if part offload; then
  off="parallel.offload_optimizer=cpu"
  [[ -f $out/z3_1.jsonl ]] || run z3_1 1 120 $gpu
  [[ -f $out/z3_2.jsonl ]] || run z3_2 2 100 $gpu
  run off_1 1 120 $gpu $off && cmp off_1 z3_1 1e-5
  run off_2 2 120 $gpu $off && cmp off_2 z3_2 1e-5 && cmp off_2 off_1 1e-5
  grep -h "memory per rank" "$out"/off_1.log | head -1 >>"$out/summary.txt"
  # fp16: the scale starts far too high, so the first steps overflow and are skipped, then the scale settles.
  fp16="model.dtype=fp16 optim.loss_scale=4294967296 optim.loss_scale_window=5"
  run fp16_1 1 120 $gpu $fp16 && run off_fp16_1 1 120 $gpu $fp16 $off && cmp off_fp16_1 fp16_1 1e-3 &&
    python3 - "$out/off_fp16_1.jsonl" "$out/fp16_1.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
sa, sb = [x["skipped"] for x in a], [x["skipped"] for x in b]
la, lb = [x.get("loss_scale") for x in a], [x.get("loss_scale") for x in b]
ok = len(a) == len(b) == 20 and sa == sb and la == lb and any(sa)
print(f"{'PASS' if ok else 'FAIL'} fp16 offload vs GPU optimizer: skipped steps {[i + 1 for i, s in enumerate(sa) if s]} "
      f"vs {[i + 1 for i, s in enumerate(sb) if s]}, scales equal: {la == lb} (last {la[-1]})")
PY
  lora="lora.rank=8 lora.alpha=16 lora.targets=q_proj,k_proj,v_proj,o_proj"
  run lora_dev_2 2 100 $gpu $lora && run lora_host_2 2 100 $gpu $lora $off parallel.offload_params=frozen &&
    cmp lora_host_2 lora_dev_2 1e-5
  grep -h "memory per rank" "$out"/lora_host_2.log | head -1 >>"$out/summary.txt"
  pack
fi

if part hostbase; then
  # The frozen base on the host (issue 29) in fp32 (streamed from the masters) and in bf16 (from a pinned bf16 copy,
  # the fp32 masters released; at one rank copied up on the ring's stream), against the base on the device: 1 and 2
  # ranks, every step's loss (bf16: the same weights, so the bound is fp32's too).
  lora="lora.rank=8 lora.alpha=16 lora.targets=q_proj,k_proj,v_proj,o_proj"
  hb="parallel.offload_optimizer=cpu parallel.offload_params=frozen"
  for dt in fp32 bf16; do
    for np in 1 2; do
      run hb_dev_${dt}_$np $np 100 $gpu $lora model.dtype=$dt &&
        run hb_host_${dt}_$np $np 100 $gpu $lora model.dtype=$dt $hb && cmp hb_host_${dt}_$np hb_dev_${dt}_$np 1e-5
      grep -h "memory per rank\|masters released" "$out"/hb_host_${dt}_$np.log | head -2 >>"$out/summary.txt"
    done
  done
  pack
fi

if part delayed; then
  # parallel.offload_update = delayed (issue 29): CUDA (parameters up on their own stream, unit by unit) against the
  # CPU op layer's run of the same deck (4 steps; 8 CPU ranks, which CI shows equal to 1), and 2 ranks sharing the GPU
  # against 1 (20 steps); then the 2B step time without offload, offloaded, and offloaded with the delayed update (the
  # issue's bound: at most 1.15x).
  dly="parallel.offload_optimizer=cpu parallel.offload_update=delayed"
  run dly_cuda_4 1 120 $gpu $dly train.steps=4 && run dly_cpu_4 8 150 model.backend=cpu $dly train.steps=4 &&
    cmp dly_cuda_4 dly_cpu_4 1e-5
  run dly_cuda_1 1 120 $gpu $dly && run dly_cuda_2 2 120 $gpu $dly && cmp dly_cuda_2 dly_cuda_1 1e-5
  for o in none sync delayed; do
    a="parallel.offload_optimizer=cpu parallel.offload_update=$o"
    [[ $o == none ]] && a="parallel.offload_optimizer=none"
    rm -rf /tmp/runs/bench_dly_$o
    timeout 300 "$q" train input/bench_2b_gpu.deck $a checkpoint.every=0 run.out_dir=/tmp/runs/bench_dly_$o \
      >"$out/bench_dly_$o.log" 2>&1
    say "bench_dly_$o: rc=$?"
    cp /tmp/runs/bench_dly_$o/metrics.jsonl "$out/bench_dly_$o.jsonl" 2>/dev/null
    rm -rf /tmp/runs/bench_dly_$o  # its final checkpoint: 25 GB of a 64 GB disk
    pack
  done
  python3 - "$out"/bench_dly_{none,sync,delayed}.jsonl >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
n, s, d = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:4])
t = lambda r, k="step": statistics.median(x["time"][k] for x in r)
ok = min(len(n), len(s), len(d)) >= 4 and n[0]["tokens"] == d[0]["tokens"] and t(d) / t(n) <= 1.15
print(f"{'PASS' if ok else 'FAIL'} 2B step time: GPU optimizer {t(n):.3f} s, offloaded {t(s):.3f} s ({t(s) / t(n):.3f}x), "
      f"offloaded + delayed update {t(d):.3f} s ({t(d) / t(n):.3f}x, bound 1.15); optimizer phase {t(n, 'optimizer'):.3f} / "
      f"{t(s, 'optimizer'):.3f} / {t(d, 'optimizer'):.3f} s; tok/s {statistics.median(x['tokens_per_s'] for x in d):.0f}")
PY
  pack
fi

if part hftrain; then
  rm -rf /tmp/runs/hft_q3vl
  timeout 240 "$q" train input/bench_2b_gpu.deck checkpoint.every=0 run.out_dir=/tmp/runs/hft_q3vl >"$out/hft_q3vl.log" 2>&1
  say "hftrain q3vl: rc=$?"
  cp /tmp/runs/hft_q3vl/metrics.jsonl "$out/hft_q3vl.jsonl" 2>/dev/null
  rm -rf /tmp/runs/hft_q3vl
  pack
  timeout 300 python3 tools/gpu/hf_train_baseline.py --out "$out/hft_hf.jsonl" >"$out/hft_hf.log" 2>&1
  say "hftrain transformers: rc=$? $(tail -1 "$out/hft_hf.log")"
  python3 - "$out/hft_q3vl.jsonl" "$out/hft_hf.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
q, h = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:3])
tq, th = (statistics.median(x["tokens_per_s"] for x in r) for r in (q, h))
print(f"2B training, steps 3-8: q3vl {tq:.0f} tokens/s (mfu {statistics.median(x['mfu'] for x in q):.3f}, step "
      f"{statistics.median(x['time']['step'] for x in q):.3f} s), transformers {th:.0f} tokens/s: {tq / th:.2f}x")
PY
  pack
fi

if part overlap || part overlap1; then  # overlap1 and overlap2: its halves, for short calls
  Q3VL_OVERLAP_UPDATE=1 run ov_1 1 120 $gpu model.dtype=bf16
  Q3VL_OVERLAP_UPDATE=0 run ov0_1 1 120 $gpu model.dtype=bf16 && cmp ov_1 ov0_1 0
fi
if part overlap; then
  Q3VL_OVERLAP_UPDATE=0 run ov0b_1 1 120 $gpu model.dtype=bf16 && cmp ov0b_1 ov0_1 0
  Q3VL_OVERLAP_UPDATE=1 run ovhalf_1 1 100 $gpu model.dtype=bf16 train.stop_after=10 checkpoint.every=10
  rm -rf /tmp/runs/ovres_1 && cp -r /tmp/runs/ovhalf_1 /tmp/runs/ovres_1
  Q3VL_OVERLAP_UPDATE=1 run ovres_1 1 100 $gpu model.dtype=bf16 train.resume=auto && cmp ovres_1 ov0_1 1e-6
fi
if part overlap || part overlap2; then
  Q3VL_OVERLAP_UPDATE=1 run ov_2 2 100 $gpu
  Q3VL_OVERLAP_UPDATE=0 run ov0_2 2 100 $gpu && cmp ov_2 ov0_2 0
fi

if part inbwd; then
  ub="optim.clip=0 optim.update_in_backward=true"
  run ubref_1 1 120 $gpu model.dtype=bf16 optim.clip=0
  run ub_1 1 120 $gpu model.dtype=bf16 $ub && cmp ub_1 ubref_1 0
  Q3VL_UPDATE_PRIO=low run ublow_1 1 120 $gpu model.dtype=bf16 $ub && cmp ublow_1 ubref_1 0
  run ubref_2 2 100 $gpu optim.clip=0 train.grad_accum=2
  run ub_2 2 100 $gpu $ub train.grad_accum=2 && cmp ub_2 ubref_2 0
  run ubnan_1 1 100 $gpu model.dtype=bf16 $ub train.debug_nan_step=3 train.steps=6
  say "ubnan_1: $(grep -o 'step 3: non-finite gradients in [^(]*([^)]*)' "$out/ubnan_1.log"); $(wc -l < "$out/ubnan_1.jsonl") steps"
  # The MoE golden model: the experts' dW squares taken in the grouped GEMM's epilogue, the units' checks adding
  # those slots (DevTrainer::unit_squares) instead of reading the gradients again.
  moe="model.hf=tests/data/golden/moe/model"
  run ubmoeref_1 1 100 $gpu $moe model.dtype=bf16 optim.clip=0
  run ubmoe_1 1 100 $gpu $moe model.dtype=bf16 $ub && cmp ubmoe_1 ubmoeref_1 0
  # Q3VL_UPDATE_HOLD=experts: the units completed before the last expert unit updated after it, in order: equal.
  Q3VL_UPDATE_HOLD=experts run ubhold_1 1 100 $gpu $moe model.dtype=bf16 $ub && cmp ubhold_1 ubmoeref_1 0
  say "ubhold_1: $(grep -o 'the update in the backward: [0-9]* units held[^(]*' "$out/ubhold_1.log")"
  say "ubmoe_1: $(grep -o "gradient norm and the update's check: [0-9]* gradients ([^)]*)" "$out/ubmoe_1.log")"
  pack
fi

if part moe; then
  # moe_q3vl: the baseline's shape (an optimizer step every 4096 tokens); moe_q3vl_ga4: 4 micro-steps of 4096
  # tokens a step, the AdamW pass over the ~5 B fp32 masters (~30 ms of HBM traffic) amortised.
  for r in moe_q3vl moe_q3vl_ga4; do
    rm -rf /tmp/runs/$r
    timeout 300 "$q" train input/bench_30b_a3b_gpu.deck checkpoint.every=0 run.out_dir=/tmp/runs/$r \
      train.global_batch=$([ $r = moe_q3vl ] && echo 1 || echo 4) >"$out/$r.log" 2>&1
    say "$r: rc=$?"
    cp /tmp/runs/$r/metrics.jsonl "$out/$r.jsonl" 2>/dev/null
    rm -rf /tmp/runs/$r
    pack
  done
  timeout 400 python3 tools/gpu/hf_train_baseline.py --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096 \
    --out "$out/moe_hf.jsonl" >"$out/moe_hf.log" 2>&1
  say "moe transformers: rc=$? $(tail -1 "$out/moe_hf.log")"
  python3 - "$out/moe_q3vl.jsonl" "$out/moe_hf.jsonl" "$out/moe_q3vl_ga4.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
q, h = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:3])
tq, th = (statistics.median(x["tokens_per_s"] for x in r) for r in (q, h))
mq, mh = (statistics.median(x["mfu"] for x in r) for r in (q, h))
print(f"30B-A3B x 6 layers training, 1 x 4096 tokens, steps 3-8: q3vl {tq:.0f} tokens/s (mfu {mq:.3f} on active "
      f"parameters, step {statistics.median(x['time']['step'] for x in q):.3f} s), transformers {th:.0f} tokens/s "
      f"(mfu {mh:.3f}): {tq / th:.2f}x (goal: >= 4x, mfu >= 0.30)")
g = [json.loads(l) for l in open(sys.argv[3])][2:]
print(f"  q3vl with 4 micro-steps a step (16384 tokens): {statistics.median(x['tokens_per_s'] for x in g):.0f} "
      f"tokens/s, mfu {statistics.median(x['mfu'] for x in g):.3f}")
PY
  pack
fi

if part video; then
  t0=$SECONDS
  timeout 300 python3 tools/make_video_goldens.py /tmp/video_goldens >"$out/video_goldens.log" 2>&1
  say "video goldens: rc=$? $((SECONDS - t0)) s: $(tail -1 /tmp/video_goldens/make_video_goldens.log)"
  cp -r /tmp/video_goldens "$out/video_goldens"
  mkdir -p tests/data/video && cp /tmp/video_goldens/processor.h5 /tmp/video_goldens/make_video_goldens.log tests/data/video/
  for c in video_dense video_moe; do rm -rf tests/data/golden/$c && cp -r /tmp/video_goldens/$c tests/data/golden/$c; done
  pack
  t0=$SECONDS
  Q3VL_REQUIRE_GPU=1 timeout 120 "$ut" --gtest_filter='VideoGolden.*:Golden.*Video*:Video*.*-VideoDecode.*' \
    >"$out/video_unit.log" 2>&1
  say "video unit: rc=$? $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$out/video_unit.log" | tr '\n' ' ')"
  pack
fi

if part profile; then
  rm -rf /tmp/runs/profile
  t0=$SECONDS
  timeout 300 "$q" train input/bench_2b_gpu.deck train.steps=4 checkpoint.every=0 run.profile=true \
    run.profile_step=3 run.out_dir=/tmp/runs/profile >"$out/profile.log" 2>&1
  say "profile: rc=$? $((SECONDS - t0)) s"
  cp /tmp/runs/profile/metrics.jsonl "$out/profile.jsonl" 2>/dev/null
  rm -rf /tmp/runs/profile  # the final checkpoint: 25 GB
  python3 - "$out/profile.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, sys
p = next(l["profile"] for l in map(json.loads, open(sys.argv[1])) if "profile" in l)
print(f"profile of step {p['step']}: {p['step_ms']:.1f} ms, compute stream busy {p['busy_ms']:.1f} ms, "
      f"exposed communication {p['exposed_comm_ms']:.1f} ms, {p['regions']} regions")
print("  phases: " + ", ".join(f"{x['name']} {x['ms']:.1f} ms ({x['pct']:.1f}%)" for x in p["phases"]))
for o in p["ops"][:12]:
    rate = f"{o['tflops']:.1f} TFLOP/s" if "tflops" in o else f"{o['gbps']:.0f} GB/s" if "gbps" in o else ""
    print(f"  {o['name']:<44} {o['calls']:>6} {o['ms']:>10.2f} ms {o['pct']:>5.1f}%  {rate}")
PY
  pack
fi
if part big; then
  t0=$SECONDS
  timeout 120 "$q" check model.backend=cuda >"$out/check.log" 2>&1
  say "check: rc=$? $((SECONDS - t0)) s: $(grep -m1 'offload rates' "$out/check.log")"
  hgbs=$(sed -n 's/.*plan.host_gbs = \([0-9.]*\).*/\1/p' "$out/check.log" | head -1)
  pgbs=$(sed -n 's/.*plan.pcie_gbs = \([0-9.]*\).*/\1/p' "$out/check.log" | head -1)
  hw="plan.gpus_per_node=1 plan.host_mem=$(awk '/MemTotal/ {print $2}' /proc/meminfo)KiB plan.host_gbs=${hgbs:-0} plan.pcie_gbs=${pgbs:-0}"
  say "host: $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ' '); plan inputs: $hw"
  pack
  cut="input/qwen3vl_235b_lora.deck model.hf= model.preset=235B-A22B model.text_layers=4 parallel.ep=1
       train.dataset=synthetic train.synthetic_samples=64 train.synthetic_image_px=448 train.max_patches=8192
       train.global_batch=2 train.steps=6 train.resume=never checkpoint.every=0 runtime.timeout=300"
  for b in ${BIG:-8b 235b}; do
    if [[ $b == 8b ]]; then args="input/bench_8b_offload.deck checkpoint.every=0"; else args=$cut; fi
    "$q" plan $args $hw plan.show=40 >"$out/plan_$b.log" 2>&1
    rm -rf /tmp/runs/big_$b
    t0=$SECONDS
    timeout 420 "$q" train $args run.out_dir=/tmp/runs/big_$b >"$out/big_$b.log" 2>&1
    say "big_$b: rc=$? $((SECONDS - t0)) s"
    grep -E "start-up done|memory per rank|error" "$out/big_$b.log" | head -4 >>"$out/summary.txt"
    cp /tmp/runs/big_$b/metrics.jsonl "$out/big_$b.jsonl" 2>/dev/null
    rm -rf /tmp/runs/big_$b
    python3 - "$out/big_$b.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])][2:]
m = lambda k: statistics.median(x[k] for x in r)
print(f"  steps 3-{len(r) + 2}: step {statistics.median(x['time']['step'] for x in r):.2f} s, {m('tokens_per_s'):.0f} "
      f"tokens/s, mfu {m('mfu'):.3f}, {r[0]['tokens']} tokens a step, rss {max(x['rss_mib'] for x in r):.0f} MiB, "
      f"optimizer phase {statistics.median(x['time']['optimizer'] for x in r):.3f} s")
PY
    pack
  done
fi
if part partial; then
  po="parallel.offload_optimizer=cpu parallel.offload_ratio=0.5"
  [[ -f $out/z3_1.jsonl ]] || run z3_1 1 120 $gpu
  [[ -f $out/z3_2.jsonl ]] || run z3_2 2 100 $gpu
  run part_1 1 120 $gpu $po && cmp part_1 z3_1 1e-5
  run part_2 2 120 $gpu $po && cmp part_2 z3_2 1e-5
  run partd_1 1 120 $gpu $po parallel.offload_update=delayed &&
    run partd_2 2 120 $gpu $po parallel.offload_update=delayed && cmp partd_2 partd_1 1e-5
  grep -h "partial offload" "$out"/part_1.log | head -1 | grep -o "partial offload.*" >>"$out/summary.txt"
  for r in none ${RATIOS:-0.7 0.5}; do
    a="parallel.offload_optimizer=cpu parallel.offload_update=delayed parallel.offload_ratio=$r"
    [[ $r == none ]] && a="parallel.offload_optimizer=none"
    rm -rf /tmp/runs/bench_part
    timeout 200 "$q" train input/bench_2b_gpu.deck $a checkpoint.every=0 run.out_dir=/tmp/runs/bench_part \
      >"$out/bench_part_$r.log" 2>&1
    say "bench_part_$r: rc=$? $(grep -o 'partial offload: [^;]*' "$out/bench_part_$r.log" | head -1)"
    cp /tmp/runs/bench_part/metrics.jsonl "$out/bench_part_$r.jsonl" 2>/dev/null
    rm -rf /tmp/runs/bench_part
    python3 - "$out/bench_part_none.jsonl" "$out/bench_part_$r.jsonl" "$r" >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
n, d = ([json.loads(l) for l in open(f)][2:] for f in sys.argv[1:3])
t = lambda r, k="step": statistics.median(x["time"][k] for x in r)
print(f"  2B ratio {sys.argv[3]}: step {t(d):.3f} s against {t(n):.3f} s: {t(d) / t(n):.3f}x (bound 1.15), optimizer phase "
      f"{t(d, 'optimizer'):.3f} s, tokens {d[0]['tokens']} / {n[0]['tokens']}, tok/s {statistics.median(x['tokens_per_s'] for x in d):.0f}, "
      f"zero state {d[0].get('memory_mib', {}).get('zero_state', 0):.0f} MiB")
PY
    pack
  done
fi

if part ring; then
  for c in 1048576 4194304; do
    for o in sync delayed; do
      rm -rf /tmp/runs/ring
      timeout 200 "$q" train input/bench_2b_gpu.deck parallel.offload_optimizer=cpu parallel.offload_update=$o \
        parallel.offload_chunk=$c checkpoint.every=0 run.out_dir=/tmp/runs/ring >"$out/ring_${o}_$c.log" 2>&1
      say "ring_${o}_$c: rc=$?"
      cp /tmp/runs/ring/metrics.jsonl "$out/ring_${o}_$c.jsonl" 2>/dev/null
      rm -rf /tmp/runs/ring
      python3 - "$out/ring_${o}_$c.jsonl" >>"$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])][2:]
t = lambda k: statistics.median(x["time"][k] for x in r)
print(f"  steps 3-{len(r) + 2}: step {t('step'):.3f} s, optimizer phase {t('optimizer'):.3f} s")
PY
      pack
    done
  done
fi
pack
