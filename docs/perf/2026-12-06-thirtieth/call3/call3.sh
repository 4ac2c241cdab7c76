#!/usr/bin/env bash
# call 3 (thirtieth session, binaries of 9f7900b; calls 1 and 2 never got a machine): (1) chain_bench (16 layers of
# the 8B's fp8 linears: plain, the persistent chain of gemv_chain.cuh a layer, for all layers, and for o_proj +
# gate_up + down with qkv apart, asking L2 for 0 and 8 stages past the ring) by default and with Q3VL_GEMV_TMA=1;
# (2) one stream of the 8B fp8: default, Q3VL_DECODE_CHAIN=1, Q3VL_GEMV_TMA=1, both; (3) the op table's 8-bit linear
# cases (with linear_q8_chain's) and MoE combine cases, and DevInfer.* by default and with Q3VL_DECODE_CHAIN=1;
# (4) on an H200 with room left, issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call3
for e in "" "Q3VL_GEMV_TMA=1"; do
  echo "## env: ${e:-default}"; env $e timeout 60 /tmp/rt/bin/chain_bench 16 30 0,5,6,7 0,8
done > "$out/chain16.txt" 2>&1
say "chain: $(grep -E '^\| (none|chain|qkv, chain)' "$out/chain16.txt" | tr '\n' ' ')"; pack
serve_one fp8 8bfp8 55
serve_one fp8_chain 8bfp8 55 Q3VL_DECODE_CHAIN=1
serve_one fp8_tma 8bfp8 55 Q3VL_GEMV_TMA=1
serve_one fp8_chain_tma 8bfp8 55 Q3VL_DECODE_CHAIN=1 Q3VL_GEMV_TMA=1
Q3VL_OPS=linear_q8,moe_combine unit_gpu 'BackendOps.*:DevInfer.*' 170
cp "$out/unit.log" "$out/unit_default.log"
left 40 && Q3VL_DECODE_CHAIN=1 unit_gpu 'DevInfer.*' 35
if nvidia-smi -L | grep -q H200 && left 250; then
  vs_hf 30b
  prof_rows q30b
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
