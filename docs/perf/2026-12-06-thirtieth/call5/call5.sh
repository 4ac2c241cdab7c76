#!/usr/bin/env bash
# call 5 (written by the thirtieth session for the next one; never run: the session's device time went to refused
# starts). Binaries of fd95bb7 or later: q3vl, unit_tests and chain_bench in one devpack (call_lib.sh's header).
# (1) the op table's linear_q8_chain and moe_combine cases on the GPU (the persistent chain of gemv_chain.cuh against
# the CPU's links in turn: bf16 and fp16 are where the kernel runs; call 4's run aborted in fp32 on the test's own
# short scratch, fixed in fd95bb7), then every 8-bit linear case and DevInfer.*; (2) one stream of the 8B fp8:
# default, Q3VL_DECODE_CHAIN=1, Q3VL_GEMV_TMA=1, both (the H100 of call 4: 4.52, 4.10, 4.10, 4.05 ms a step);
# (3) chain_bench; (4) on an H200, issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call5
Q3VL_OPS=linear_q8_chain,moe_combine unit_gpu 'BackendOps.*' 100
cp "$out/unit.log" "$out/unit_chain_ops.log"
Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*:DevInfer.*' 170
cp "$out/unit.log" "$out/unit_default.log"
serve_one fp8 8bfp8 55
serve_one fp8_chain 8bfp8 55 Q3VL_DECODE_CHAIN=1
left 60 && serve_one fp8_tma 8bfp8 55 Q3VL_GEMV_TMA=1
left 60 && serve_one fp8_chain_tma 8bfp8 55 Q3VL_DECODE_CHAIN=1 Q3VL_GEMV_TMA=1
if left 60; then
  for e in "" "Q3VL_GEMV_TMA=1"; do
    echo "## env: ${e:-default}"; env $e timeout 40 /tmp/rt/bin/chain_bench 16 30 0,5,6,7
  done > "$out/chain16.txt" 2>&1
  say "chain: $(grep -E '^\| (none|chain|qkv, chain)' "$out/chain16.txt" | tr '\n' ' ')"; pack
fi
if nvidia-smi -L | grep -q H200 && left 250; then
  vs_hf 30b
  prof_rows q30b
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
