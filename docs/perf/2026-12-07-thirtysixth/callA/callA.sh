#!/usr/bin/env bash
# call A (thirty-sixth session; devpack/rt.tar.xz: the pack of 1b150ed, whose product code is 837f3fd's: the MoE link
# and the SwiGLU pair by default): issue 32's one-stream figures on the GPU lent (asked nvidia-h200), the stamps of
# chain_bench's chained layers on it. The correctness suites of this code passed on an H100 (thirty-fifth session,
# calls C and F) and are left to the next call, which runs this session's changes.
source tools/gpu/call_lib.sh callA
t1=$SECONDS
timeout 60 /tmp/rt/bin/chain_bench 16 30 8,9 > "$out/chain_bench.txt" 2>&1
say "chain_bench rc=$? $((SECONDS - t1)) s"; pack
left 130 && serve_own q30b_moe 30B-A3B ""
left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
left 60 && serve_own q8b 8B ""
left 130 && serve_own q30b 30B-A3B "" Q3VL_CHAIN_MOE=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
