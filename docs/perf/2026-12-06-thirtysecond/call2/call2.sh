#!/usr/bin/env bash
# call 2 (thirty-second session): binaries of the attention link (dev::ChainAttn, chain_attn.cuh): a decode step's
# qkv_to_cache, paged attention and split combine as the first link of its layer's chain (and as a chain of its own in
# MoE layers), its key splits sized on the device, the split holding a new position writing its key and value.
# (1) the op table's linear_chain cases (the attention link alone, between qkv and o_proj, fallbacks), qkv_to_cache
#     and paged attention, then DevInfer.* and Golden.*; (2) one stream of the 8B, fp8 and bf16, the link (default)
#     against Q3VL_CHAIN_ATTN=0, back to back; (3) serve_checks' tiny part (bf16 and fp32 answers against generate);
#     (4) on an H200, the 30B-A3B served at one stream both ways, and issue 30's cut beside transformers.
source tools/gpu/call_lib.sh call2
Q3VL_OPS=linear_chain,qkv_to_cache,paged_attention unit_gpu 'BackendOps.*' 150
cp "$out/unit.log" "$out/unit_ops.log"
unit_gpu 'DevInfer.*:Golden.*' 150
cp "$out/unit.log" "$out/unit_infer.log"
serve_one fp8 8bfp8 60
serve_one fp8_noattn 8bfp8 60 Q3VL_CHAIN_ATTN=0
left 100 && serve_one bf16 8b 80
left 100 && serve_one bf16_noattn 8b 80 Q3VL_CHAIN_ATTN=0
left 60 && serve_one tiny tiny 60
if nvidia-smi -L | grep -q H200; then
  left 120 && serve_one q30b 30b 100
  left 120 && serve_one q30b_noattn 30b 100 Q3VL_CHAIN_ATTN=0
  left 250 && vs_hf 30b
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
