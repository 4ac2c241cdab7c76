#!/usr/bin/env bash
# call 3b (thirty-second session; never ran: the device time went to refused starts and to call 3, whose H100 was
# taken back before it returned anything). For binaries of 9d3d42e or later, where the attention link is opt-in
# (Q3VL_CHAIN_ATTN=1): about 330 s of device time.
# (1) DevInfer.* (AttentionLinkMatchesHostOnCuda: the hd64 cases with the link, both dense layers as one chain kernel)
#     and Golden.*; (2) one 8B fp8 stream: the default (the attention's two ops, a chain a layer) against
#     Q3VL_CHAIN_ATTN=1 (chained layers) and Q3VL_CHAIN_ATTN=1 Q3VL_CHAIN_LAYERS=1 (the link, a chain a layer), back to
#     back; (3) the op table's linear_chain cases (the link's kernel in its current form, c00163c).
source tools/gpu/call_lib.sh call3b
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8 8bfp8 55
serve_one fp8_attn 8bfp8 55 Q3VL_CHAIN_ATTN=1
serve_one fp8_attn_layer 8bfp8 55 Q3VL_CHAIN_ATTN=1 Q3VL_CHAIN_LAYERS=1
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 90
cp "$out/unit.log" "$out/unit_ops.log"
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
