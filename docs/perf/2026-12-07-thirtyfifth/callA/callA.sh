#!/usr/bin/env bash
# call A (thirty-fifth session; the thirty-fourth call B), binaries of 529e85d: tc_pre reverted, the MoE layer's attention as its two ops, the
# attention unit's critical path shortened, gate_up's tiles writing the SwiGLU (a SwiGLU pair), a tile's end a tile
# late. About 300 s (the device time left after refused starts). (1) chain_bench: the chain (6) against the SwiGLU staged by down_proj (12) and the tile ends
# synchronous (14); decode layers with the attention link (9) against staged (13) and synchronous (15), stamped (10,
# with the attention units' phases). Should the chain hang (a deadlock of the late tile
# ends), the rest runs with Q3VL_CHAIN_SYNC_ENDS=1. (2) the op table's linear_chain cases; (3) DevInfer.* and
# Golden.*; (4) one 8B stream in fp8 and bf16; (5) one 30B-A3B stream (its attention the two ops now).
source tools/gpu/call_lib.sh callA
timeout 80 /tmp/rt/bin/chain_bench 16 50 0,6,12,14,9,13,15,10 > "$out/chain_bench.txt" 2>&1
rc=$?; say "chain_bench rc=$rc"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
if (( rc != 0 )); then
  export Q3VL_CHAIN_SYNC_ENDS=1; say "chain_bench failed: Q3VL_CHAIN_SYNC_ENDS=1 from here"
  timeout 40 /tmp/rt/bin/chain_bench 16 50 0,14,12,15 > "$out/chain_bench_sync.txt" 2>&1
  say "chain_bench (sync ends) rc=$?"; cat "$out/chain_bench_sync.txt" >> "$out/summary.txt"; pack
fi
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 130
cp "$out/unit.log" "$out/unit_ops.log"
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8 8bfp8 55
left 120 && serve_one bf16 8b 70
left 200 && serve_one q30b 30b 110
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
