#!/usr/bin/env bash
# call 1 (2026-12-02, seventh session): the GPU op table and device suites on the merged head (new attention
# backward, paged attention on tensor cores, grouped GEMM on wgmma, batched vision, GEMM autotune); then each new
# kernel's harness: checked against a reference and timed against the previous kernel.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && tar xJf devpack/tools.tar.xz -C /tmp/rt/bin && source /tmp/rt/env.sh
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
b=/tmp/rt/bin out=/tmp/res1 final=$OUT; mkdir -p $out
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
Q3VL_REQUIRE_GPU=1 timeout 240 $b/unit_tests --gtest_filter='BackendOps.*:DevLayers.*:DevVision.*:DevModel.*:DevInfer.*:Golden.*:Profile.*:StreamWeights.*' > $out/unit.txt 2>&1
say "unit rc=$? $((SECONDS-T0)) s"; grep -E "^\[  FAILED|PASSED|FAILED  \]" $out/unit.txt | head -20 >> $out/summary.txt; pack
timeout 150 $b/attn_check > $out/attn.txt 2>&1; say "attn_check rc=$? $((SECONDS-T0)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; tail -14 $out/attn.txt >> $out/summary.txt; pack
timeout 100 $b/paged_check > $out/paged.txt 2>&1; say "paged_check rc=$? $((SECONDS-T0)) s"; grep FAIL $out/paged.txt | head -5 >> $out/summary.txt; tail -12 $out/paged.txt >> $out/summary.txt; pack
timeout 120 $b/moe_bench 20 > $out/moe.txt 2>&1; say "moe_bench rc=$? $((SECONDS-T0)) s"; grep FAIL $out/moe.txt | head -5 >> $out/summary.txt; tail -12 $out/moe.txt >> $out/summary.txt; pack
timeout 120 $b/gemm_tune_bench 20 > $out/tune.txt 2>&1; say "gemm_tune_bench rc=$? $((SECONDS-T0)) s"; grep FAIL $out/tune.txt | head -5 >> $out/summary.txt; pack
Q3VL_GEMM_TUNE=1 Q3VL_REQUIRE_GPU=1 timeout 60 $b/unit_tests --gtest_filter='BackendOps.*Gemm*:BackendOps.*Linear*' > $out/unit_tuned.txt 2>&1; say "unit tuned rc=$? $((SECONDS-T0)) s"; tail -3 $out/unit_tuned.txt >> $out/summary.txt
say "done $((SECONDS-T0)) s"; pack
cat $out/summary.txt
