#!/usr/bin/env bash
# call 4 (2026-12-02, sixth session): the 30B-A3B shape cut to 6 layers, 1 x 4096 tokens, against transformers in one
# call (train_checks.sh part moe: the mma.sync grouped expert GEMM)
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
timeout 560 bash tools/gpu/train_checks.sh /tmp/rt/bin/q3vl none $OUT "moe"
cat $OUT/summary.txt; grep -h "tokens/s\|mfu" $OUT/*.log 2>/dev/null | tail -5
