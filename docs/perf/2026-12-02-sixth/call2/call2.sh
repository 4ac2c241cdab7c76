#!/usr/bin/env bash
# call 2 (2026-12-02, sixth session): the video demo's second rotary sweep (seeds; the picture model at 5e6 with the
# video stages at a small theta) beside the correctness suites (op table with the fused residual norm, the GEMV and the
# grouped GEMM; CUDA parity); then, alone on the GPU, the timings: the wgmma forward against fwd_tc, the GEMV against
# the old one and cuBLASLt, and the 2B step with and without the fusions (Q3VL_AB_OLD=1).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz && tar xJf devpack/attn.tar.xz -C /tmp/rt/bin
out=/tmp/res2 final=$OUT; mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
VARIANTS="t5s2:5:4,2,2:2 t5s3:5:4,2,2:3 t10:10:4,2,2 x5:5:4,2,2:1234:5e6 x5s2:5:4,2,2:2:5e6 x10:10:4,2,2:1234:5e6 x2:2:4,2,2:1234:5e6" \
  BUDGET_S=280 NP_PREP=6 timeout 300 bash devpack/video_demo_sweep.sh /tmp/rt/bin/q3vl /tmp/vs > $out/sweep.log 2>&1 &
sw=$!
Q3VL_REQUIRE_GPU=1 timeout 240 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevLayers.*:DevModel.*:Golden.Cuda*:DevInfer.*Cuda*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"; grep -E "FAILED|Failure" $out/unit.log | head -20 >> $out/summary.txt; pack
while kill -0 $sw 2>/dev/null; do sleep 10; mkdir -p $out/vs; cp /tmp/vs/summary.txt /tmp/vs/results.tgz $out/vs/ 2>/dev/null; pack; done
cp /tmp/vs/summary.txt /tmp/vs/results.tgz $out/vs/ 2>/dev/null; grep -v "^t[0-9a-z]*/\(pic\|stage2\)_metrics" /tmp/vs/summary.txt | grep -E "video@(2000|2500|3000)|pictures|stage 2" >> $out/summary.txt; pack
timeout 60 /tmp/rt/bin/attn_fwd_check > $out/attn_fwd.txt 2>&1; say "attn_fwd_check rc=$? $((SECONDS-T0)) s"; grep -E "FAIL" $out/attn_fwd.txt | head -5 >> $out/summary.txt; tail -9 $out/attn_fwd.txt >> $out/summary.txt; pack
# gemv_bench: call 3 (the pack is at the 64 MiB limit)
for v in new old; do
  env $([ $v = old ] && echo Q3VL_AB_OLD=1) timeout 150 /tmp/rt/bin/q3vl train input/bench_2b_gpu.deck train.steps=4 \
    checkpoint.every=0 run.profile=true run.profile_step=3 run.out_dir=/tmp/ab_$v > $out/ab_$v.log 2>&1
  say "2B $v rc=$? $((SECONDS-T0)) s: step 3 $(grep -o 'CUDA events): [0-9.]* ms' $out/ab_$v.log) losses $(grep -o '"loss":[^,]*' /tmp/ab_$v/metrics.jsonl | cut -d: -f2 | tr '\n' ' ')"
  cp /tmp/ab_$v/metrics.jsonl $out/ab_$v.jsonl; rm -rf /tmp/ab_$v; pack
done
grep -E "^  (convert|copy|axpy|rmsnorm_fwd|residual_rmsnorm_fwd|attention_fwd|linear_fwd) " $out/ab_new.log $out/ab_old.log >> $out/summary.txt
pack
cat $out/summary.txt
