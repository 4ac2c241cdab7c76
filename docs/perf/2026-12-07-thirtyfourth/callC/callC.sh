#!/usr/bin/env bash
# call C (thirty-fourth session), call B's pack (binaries of 529e85d, where the SwiGLU pair and the late tile ends are
# on by default; Q3VL_CHAIN_SYNC_ENDS=1 the synchronous ends), cut to the device time left after refused starts
# (~200 s): (1) chain_bench, 30 replays: the chain (6) against the SwiGLU staged (12) and synchronous tile ends (14);
# decode layers with the attention link (9) against staged (13) and synchronous (15); (2) the op table's
# linear_chain cases (paired and staged, the attention link alone and chained).
source tools/gpu/call_lib.sh callC
timeout 60 /tmp/rt/bin/chain_bench 16 30 0,6,12,14,9,13,15 > "$out/chain_bench.txt" 2>&1
rc=$?; say "chain_bench rc=$rc"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
(( rc != 0 )) && export Q3VL_CHAIN_SYNC_ENDS=1 && say "chain_bench failed: Q3VL_CHAIN_SYNC_ENDS=1 from here"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 120
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
