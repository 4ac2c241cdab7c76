#!/usr/bin/env bash
# Issue 13's GPU checks in one call on the GPU machine (from the repo root, the packed runtime sourced):
#   tools/gpu/run_checks.sh Q3VL UNIT_TESTS OUTDIR
# - the GPU test suites (op table, layers, device model, golden parity) with Q3VL_REQUIRE_GPU=1;
# - the demo model, 200 steps on synthetic data: the CPU backend (8 ranks, ZeRO-3) beside the GPU in fp32, bf16 and
#   fp16 (dynamic loss scaling from a scale that overflows), and a GPU -> CPU -> GPU restart of the fp32 run;
# - the 2B shape (input/bench_2b_gpu.deck): tokens/s, MFU, device memory.
# Everything lands in OUTDIR/results.tgz (metrics.jsonl per run, logs, nvidia-smi memory samples), refreshed after
# every part so that a call cut short still returns what finished.
set -u
q=$1 ut=$2 final=$3 out=/tmp/results
mkdir -p "$out" "$final"
pack() { tar czf "$final/results.tgz" -C "$out" . && cp "$out/summary.txt" "$final/"; }
export OPENBLAS_NUM_THREADS=1
demo="input/demo.deck train.dataset=synthetic train.synthetic_samples=4000 train.steps=200 checkpoint.every=0"
run() {  # run NAME TIMEOUT CMD...: log and metrics of one training run
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" run.out_dir=/tmp/runs/$name >"$out/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s" >>"$out/summary.txt"
  cp /tmp/runs/$name/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
  pack
}
nvidia-smi -L >"$out/summary.txt"
(run cpu 300 mpiexec -n 8 "$q" train $demo) &
cpu=$!
t0=$SECONDS
Q3VL_REQUIRE_GPU=1 timeout 90 "$ut" --gtest_filter='BackendOps.*:DevLayers.*:DevVision.*:DevModel.*:Golden.*' \
  >"$out/unit.log" 2>&1
echo "unit: rc=$? $((SECONDS - t0)) s" >>"$out/summary.txt"
pack
run gpu_fp32 60 "$q" train $demo model.backend=cuda
run gpu_bf16 60 "$q" train $demo model.backend=cuda model.dtype=bf16
run gpu_fp16 60 "$q" train $demo model.backend=cuda model.dtype=fp16 optim.loss_scale=1e9
run restart_a 60 "$q" train $demo model.backend=cuda train.stop_after=100
cp -r /tmp/runs/restart_a /tmp/runs/restart_b && cp -r /tmp/runs/restart_a /tmp/runs/restart_c
run restart_b 60 mpiexec -n 4 "$q" train $demo train.stop_after=20
cp -r /tmp/runs/restart_b/. /tmp/runs/restart_c/
run restart_c 60 "$q" train $demo model.backend=cuda
# The 2B shape: memory sampled while it runs; the final checkpoint (25 GB) is not waited for.
(while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done >"$out/bench_mem.txt") &
mem=$!
( "$q" train input/bench_2b_gpu.deck run.out_dir=/tmp/runs/bench >"$out/bench.log" 2>&1 ) &
b=$!
for _ in $(seq 120); do
  sleep 1
  [[ -f /tmp/runs/bench/metrics.jsonl ]] && (($(wc -l </tmp/runs/bench/metrics.jsonl) >= 8)) && break
  kill -0 $b 2>/dev/null || break
done
kill $b 2>/dev/null; pkill -f bench_2b_gpu; kill $mem
cp /tmp/runs/bench/metrics.jsonl "$out/bench.jsonl" 2>/dev/null
echo "bench: max GPU memory used $(sort -n "$out/bench_mem.txt" | tail -1) MiB" >>"$out/summary.txt"
cp /tmp/runs/bench/metrics.jsonl "$out/bench.jsonl" 2>/dev/null
pack
wait $cpu
pack
