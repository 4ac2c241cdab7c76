#!/usr/bin/env bash
# call B (thirty-fifth session): binaries of this session's head, where the MoE block joins the decode chain behind
# Q3VL_CHAIN_MOE=1 and the SwiGLU pair and the late tile ends stay behind Q3VL_CHAIN_SWIGLU=1 and
# Q3VL_CHAIN_LATE_ENDS=1. (1) DevInfer's MoE link tests (a hang of the MoE jobs ends them at 40 s), then the op
# table's linear_chain cases (the MoE link's among them), then DevInfer.* and Golden.*; (2) one 30B-A3B bf16 stream
# with the MoE link and without it; (3) chain_bench's A/B of the pair and the late ends; (4) one 8B fp8 stream with
# both and without.
source tools/gpu/call_lib.sh callB
unit_gpu 'DevInfer.MoeLink*' 40
moe_ok=0; grep -q '^\[  PASSED  \] 2 tests' "$out/unit.log" && ! grep -q '^\[  FAILED' "$out/unit.log" && moe_ok=1
cp "$out/unit.log" "$out/unit_moelink.log"
Q3VL_OPS=linear_chain unit_gpu 'BackendOps.*' 130
cp "$out/unit.log" "$out/unit_ops.log"
left 330 && unit_gpu 'DevInfer.*:Golden.*' 70 && cp "$out/unit.log" "$out/unit_infer.log"
if (( moe_ok )); then
  left 230 && serve_one q30b_moe 30b 110 Q3VL_CHAIN_MOE=1
else
  say "DevInfer.MoeLink* did not pass: no 30B-A3B run with the MoE link"
fi
left 120 && serve_one q30b 30b 110
left 60 && { timeout 50 /tmp/rt/bin/chain_bench 16 50 0,6,12,14 > "$out/chain_bench.txt" 2>&1
             say "chain_bench rc=$?"; cat "$out/chain_bench.txt" >> "$out/summary.txt"; pack; }
left 60 && serve_one fp8_new 8bfp8 55 Q3VL_CHAIN_SWIGLU=1 Q3VL_CHAIN_LATE_ENDS=1
left 60 && serve_one fp8 8bfp8 55
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
