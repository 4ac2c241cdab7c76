#!/usr/bin/env bash
# call C (thirty-third session), binaries of 6423ff2: the attention link on by default, the tiles' scales and
# added-to y loaded ahead (tc_pre). About 230 s. (1) chain_bench: the chain with tc_pre (6) against the loads at the
# tiles' ends (12), stamped (8); decode layers with their attention: the two ops (11), the link (9), the link with
# late loads (13), stamped (10, with stamps inside the attention units); (2) DevInfer.* and Golden.*; (3) the op
# table's linear_chain cases (tc_pre in the chain and, where the chain does not take the links, in k_gemv_tma);
# (4) one 8B stream in fp8, the new default (bf16 where time is left).
source tools/gpu/call_lib.sh callC
timeout 60 /tmp/rt/bin/chain_bench 16 50 0,6,12,8,11,9,13,10 > "$out/chain_bench.txt" 2>&1
say "chain_bench rc=$?"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 100
cp "$out/unit.log" "$out/unit_ops.log"
serve_one fp8 8bfp8 55
(( SECONDS - T0 < 160 )) && serve_one bf16 8b 70  # what little device time is left
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
