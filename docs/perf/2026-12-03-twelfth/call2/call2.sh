#!/usr/bin/env bash
# call 2 (2026-12-03, twelfth session): gemv_bench with the bulk ring's copies spread over the warps, 2-4 KiB a row
# a stage.
set -u
xz -dc devpack2/gemv_bench.xz > /tmp/gemv_bench && chmod +x /tmp/gemv_bench
timeout 200 /tmp/gemv_bench 60 > $OUT/gemv_bench.txt 2> $OUT/gemv_bench.err
echo "rc=$? $(grep -c FAIL $OUT/gemv_bench.txt) FAIL rows"; tail -2 $OUT/gemv_bench.err
