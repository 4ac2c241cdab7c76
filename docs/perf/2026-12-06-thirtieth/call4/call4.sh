#!/usr/bin/env bash
# call 4 (thirtieth session, binaries of 9f7900b; calls 1-3 never got a machine, 584 s of device time left): call 3's
# parts in the order that matters with the time cut short: chain_bench, the op table's 8-bit linear cases (the
# persistent chain against the CPU) and DevInfer.*, one stream of the 8B fp8 with and without Q3VL_DECODE_CHAIN=1,
# DevInfer.* through the chain, then Q3VL_GEMV_TMA=1 runs.
source tools/gpu/call_lib.sh call4
for e in "" "Q3VL_GEMV_TMA=1"; do
  echo "## env: ${e:-default}"; env $e timeout 60 /tmp/rt/bin/chain_bench 16 30 0,5,6,7 0,8
done > "$out/chain16.txt" 2>&1
say "chain: $(grep -E '^\| (none|chain|qkv, chain)' "$out/chain16.txt" | tr '\n' ' ')"; pack
Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*:DevInfer.*' 170
cp "$out/unit.log" "$out/unit_default.log"
serve_one fp8 8bfp8 55
serve_one fp8_chain 8bfp8 55 Q3VL_DECODE_CHAIN=1
Q3VL_DECODE_CHAIN=1 unit_gpu 'DevInfer.*' 35
cp "$out/unit.log" "$out/unit_chain.log"
serve_one fp8_chain_tma 8bfp8 55 Q3VL_DECODE_CHAIN=1 Q3VL_GEMV_TMA=1
serve_one fp8_tma 8bfp8 55 Q3VL_GEMV_TMA=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
