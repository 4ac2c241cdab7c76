#!/usr/bin/env bash
# call D (thirty-fourth session), call B's pack (binaries of 529e85d), cut to ~100 s of the device time left: chain_bench
# (30 replays): the chain (6) against the SwiGLU staged (12) and synchronous tile ends (14), the attention link
# chained (9) against staged (13) and synchronous (15): x of 6, 12 and 14 (and of 9, 13, 15) must agree to the last
# bit where the pair and the late ends keep the arithmetic; then DevInfer.* and Golden.*.
source tools/gpu/call_lib.sh callD
timeout 60 /tmp/rt/bin/chain_bench 16 30 0,6,12,14,9,13,15 > "$out/chain_bench.txt" 2>&1
rc=$?; say "chain_bench rc=$rc"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
(( rc != 0 )) && export Q3VL_CHAIN_SYNC_ENDS=1 && say "chain_bench failed: Q3VL_CHAIN_SYNC_ENDS=1 from here"
unit_gpu 'DevInfer.*:Golden.*' 30
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
