#!/usr/bin/env bash
# call C (thirty-fifth session): call B reordered for the device time left after refused starts (binaries of
# 6339468: the MoE link behind Q3VL_CHAIN_MOE=1, the SwiGLU pair and late tile ends behind Q3VL_CHAIN_SWIGLU=1 and
# Q3VL_CHAIN_LATE_ENDS=1). DevInfer's MoE link tests first (a hang ends them at 40 s), one 30B-A3B bf16 stream with
# the MoE link and without it, then the op table's linear_chain cases, chain_bench's A/B of the pair and late ends,
# one 8B fp8 stream with both and without, as the time allows.
source tools/gpu/call_lib.sh callC
unit_gpu 'DevInfer.MoeLink*' 40
moe_ok=0; grep -q '^\[  PASSED  \] 2 tests' "$out/unit.log" && ! grep -q '^\[  FAILED' "$out/unit.log" && moe_ok=1
cp "$out/unit.log" "$out/unit_moelink.log"
if (( moe_ok )); then serve_one q30b_moe 30b 100 Q3VL_CHAIN_MOE=1
else say "DevInfer.MoeLink* did not pass: no 30B-A3B run with the MoE link"; fi
serve_one q30b 30b 100
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 110
cp "$out/unit.log" "$out/unit_ops.log"
left 50 && { timeout 45 /tmp/rt/bin/chain_bench 16 50 0,6,12,14 > "$out/chain_bench.txt" 2>&1
             say "chain_bench rc=$?"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack; }
left 45 && serve_one fp8_new 8bfp8 45 Q3VL_CHAIN_SWIGLU=1 Q3VL_CHAIN_LATE_ENDS=1
left 45 && serve_one fp8 8bfp8 45
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
