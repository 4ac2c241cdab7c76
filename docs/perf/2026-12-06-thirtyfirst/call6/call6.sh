#!/usr/bin/env bash
# call 6 (thirty-first session): binaries of 4a566c7 (k_gemv_tma and k_gemv_chain share TmaSmem and tma_tile), with the decode chain made the default (Q3VL_DECODE_CHAIN=0 turns it off), the
# next layer's qkv inside it, and 16-bit weights in it (dev::linear_chain; linear_fwd's RowsIn and add). One devpack
# of q3vl, unit_tests and chain_bench (call_lib.sh's header).
# (1) the op table's linear_chain cases (int8, fp8, w16; bf16/fp16 are where the persistent kernel runs), then every
#     linear case, DevInfer.* and Golden.*; (2) one stream of the 8B, fp8 and bf16, the chain (default) against
#     Q3VL_DECODE_CHAIN=0, back to back; (3) chain_bench; (4) on an H200, issue 30's 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh call6
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 100
cp "$out/unit.log" "$out/unit_chain_ops.log"
Q3VL_OPS=linear,moe_combine unit_gpu 'BackendOps.*:DevInfer.*:Golden.*' 200
cp "$out/unit.log" "$out/unit_linear.log"
serve_one fp8 8bfp8 60
serve_one fp8_nochain 8bfp8 60 Q3VL_DECODE_CHAIN=0
left 90 && serve_one bf16 8b 80
left 90 && serve_one bf16_nochain 8b 80 Q3VL_DECODE_CHAIN=0
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
