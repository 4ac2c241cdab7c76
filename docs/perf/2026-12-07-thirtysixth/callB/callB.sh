#!/usr/bin/env bash
# call B (thirty-sixth session): the chain kernel's three new TmaKnobs flags (TmaChain: two accumulators a warp, the
# tiles' scales copied into shared memory by the producer, two sums buffers), on by default in this pack. The op
# table's linear_chain cases (bf16, fp16) and DevInfer.* / Golden.* check them; chain_bench times each flag alone
# against none and all; then one stream each of the 8B fp8, the 8B bf16 and the 30B-A3B bf16 (call A ran the same
# three with the flags off, on another H100 of this kind).
source tools/gpu/call_lib.sh callB
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.Bf16:BackendOps.Fp16' 120
cp "$out/unit.log" "$out/unit_ops.log"
unit_gpu 'DevInfer.*:Golden.*' 60
cp "$out/unit.log" "$out/unit_infer.log"
t1=$SECONDS
timeout 90 /tmp/rt/bin/chain_bench 16 30 6,14,15,16,17,9,18,8,19 > "$out/chain_bench.txt" 2>&1
say "chain_bench rc=$? $((SECONDS - t1)) s"; grep -E '^\| (chain|attn|none)' "$out/chain_bench.txt" >> "$out/summary.txt"; pack
left 60 && serve_own q8b_fp8 8B "model.weight_dtype=fp8"
left 60 && serve_own q8b 8B ""
left 130 && serve_own q30b_moe 30B-A3B ""
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
