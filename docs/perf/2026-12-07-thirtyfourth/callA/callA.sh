#!/usr/bin/env bash
# call A (thirty-fourth session), binaries of 6423ff2 (the pack of the thirty-third session, never run): the
# thirty-third session's call C, then the 30B-A3B at one stream both ways (call D's first half). About 460 s.
# (1) chain_bench: the chain with tc_pre (6) against the loads at the tiles' ends (12), stamped (8); decode layers with
# their attention: the two ops (11), the link (9), the link with late loads (13), stamped (10); (2) DevInfer.* and
# Golden.*; (3) the op table's linear_chain cases; (4) one 8B stream in fp8 and bf16; (5) the 30B-A3B at one stream,
# the default against Q3VL_CHAIN_ATTN=0.
source tools/gpu/call_lib.sh callA
timeout 60 /tmp/rt/bin/chain_bench 16 50 0,6,12,8,11,9,13,10 > "$out/chain_bench.txt" 2>&1
say "chain_bench rc=$?"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 100
cp "$out/unit.log" "$out/unit_ops.log"
serve_one fp8 8bfp8 55
serve_one bf16 8b 70
left 120 && serve_one q30b 30b 110
left 120 && serve_one q30b_noattn 30b 110 Q3VL_CHAIN_ATTN=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
