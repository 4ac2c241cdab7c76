#!/usr/bin/env bash
# call 1 (thirtieth session; q3vl and unit_tests of d02737e, chain_bench of eab8d47): (1) tools/gpu/chain_bench (16
# layers of the 8B's fp8 linears as one graph; the persistent chain of gemv_chain.cuh a layer, for all layers, and for
# o_proj + gate_up + down with qkv apart, each asking L2 for 0, 8 and 16 stages past its ring) by default and with
# Q3VL_GEMV_TMA=1; (2) one stream of the 8B fp8, default and Q3VL_GEMV_TMA=1 (the H100
# gained 11% a token with it: does the H200?); (3) on an H200, issue 30's 30B-A3B cut (6 layers, 1 x 4096 tokens)
# beside transformers, with its profile rows.
source tools/gpu/call_lib.sh call1
for e in "" "Q3VL_GEMV_TMA=1"; do
  echo "## env: ${e:-default}"; env $e timeout 90 /tmp/rt/bin/chain_bench 16 50 0,5,6,7 0,8,16
done > "$out/chain16.txt" 2>&1
say "chain: $(grep -E '^\| (none|chain|qkv, chain)' "$out/chain16.txt" | tr '\n' ' ')"; pack
serve_one fp8 8bfp8 55
serve_one fp8_tma 8bfp8 55 Q3VL_GEMV_TMA=1
if nvidia-smi -L | grep -q H200 && left 200; then
  vs_hf 30b
  prof_rows q30b
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
