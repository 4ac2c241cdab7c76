#!/usr/bin/env bash
# call A (thirty-third session), binaries of 9d3d42e (the attention link opt-in: Q3VL_CHAIN_ATTN=1). About 480 s.
# (1) DevInfer.* and Golden.* (AttentionLinkMatchesHostOnCuda: the hd64 cases with the link, both dense layers one
#     chain kernel); (2) the op table's linear_chain cases (the link's kernel in its current form, c00163c);
# (3) one 8B fp8 stream: the default (the attention's two ops, a chain a layer) against Q3VL_CHAIN_ATTN=1 (chained
#     layers) and Q3VL_CHAIN_ATTN=1 Q3VL_CHAIN_LAYERS=1 (the link, a chain a layer), back to back; (4) one 8B bf16
#     stream, the default against Q3VL_CHAIN_ATTN=1; (5) where the pack has it, chain_bench with its stamps (mode 8:
#     where a chained layer's time goes between barriers, tails and the ring; modes 9-11: decode layers with their
#     attention, the link in the chain against its two ops, and the link stamped).
source tools/gpu/call_lib.sh callA
bench() {
  [[ -x /tmp/rt/bin/chain_bench ]] || return 0
  timeout 60 /tmp/rt/bin/chain_bench 16 50 0,5,6,8,11,9,10 > "$out/chain_bench.txt" 2>&1
  say "chain_bench rc=$?"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack
}
bench
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 90
cp "$out/unit.log" "$out/unit_ops.log"
serve_one fp8 8bfp8 55
serve_one fp8_attn 8bfp8 55 Q3VL_CHAIN_ATTN=1
serve_one fp8_attn_layer 8bfp8 55 Q3VL_CHAIN_ATTN=1 Q3VL_CHAIN_LAYERS=1
left 150 && serve_one bf16 8b 70
left 75 && serve_one bf16_attn 8b 70 Q3VL_CHAIN_ATTN=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
