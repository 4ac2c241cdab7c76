#!/usr/bin/env bash
# call 1 (2026-12-02, sixth session): the new kernels against the old ones and their references (attention backward
# tiles, the wgmma attention forward, the mma.sync grouped expert GEMM), the op table on the defaults, then the video
# demo's rotary sweep in what is left of the call.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz && tar xJf devpack/attn.tar.xz -C /tmp/rt/bin
out=/tmp/res1 final=$OUT; mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 100 /tmp/rt/bin/attn_check > $out/attn_bwd.txt 2>&1; say "attn_check rc=$? $((SECONDS-T0)) s"; tail -14 $out/attn_bwd.txt >> $out/summary.txt; pack
timeout 80 /tmp/rt/bin/attn_fwd_check > $out/attn_fwd.txt 2>&1; say "attn_fwd_check rc=$? $((SECONDS-T0)) s"; tail -12 $out/attn_fwd.txt >> $out/summary.txt; pack
timeout 80 /tmp/rt/bin/moe_bench 20 > $out/moe_bench.txt 2>&1; say "moe_bench rc=$? $((SECONDS-T0)) s"; tail -12 $out/moe_bench.txt >> $out/summary.txt; pack
Q3VL_REQUIRE_GPU=1 timeout 120 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevLayers.*Cuda*:DevModel.*Cuda*' > $out/ops.log 2>&1
say "op table rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/ops.log | tr '\n' ' ')"; grep -E "FAIL|Failure" $out/ops.log | head -20 >> $out/summary.txt; pack
left=$((560 - (SECONDS - T0)))
say "sweep budget $left s"
VARIANTS="t5e6:5e6:4,2,2 t100:100:4,2,2 t20:20:4,2,2 t5:5:4,2,2" BUDGET_S=$left NP_PREP=6 \
  timeout $((left + 15)) bash devpack/video_demo_sweep.sh /tmp/rt/bin/q3vl /tmp/vs > $out/sweep.log 2>&1 &
sw=$!
while kill -0 $sw 2>/dev/null; do sleep 20; mkdir -p $out/vs; cp /tmp/vs/summary.txt $out/vs/ 2>/dev/null; cp /tmp/vs/results.tgz $out/vs/ 2>/dev/null; pack; done
cp /tmp/vs/summary.txt /tmp/vs/results.tgz $out/vs/ 2>/dev/null; cat /tmp/vs/summary.txt >> $out/summary.txt; pack
cat $out/summary.txt
