#!/usr/bin/env bash
# call 2 (twenty-seventh session): (1) the op table's linear and argmax cases, DevInfer.* and Golden.* with the new
# GEMV defaults (bf16 on cuBLASLt; the TMA GEMV for 8-bit products of 2-8 rows or 64 MiB), and the 8-bit linear cases
# again with Q3VL_GEMV_TMA=1 (every one-row product through the TMA GEMV); (2) train_checks.sh part overlap: the
# optimizer update overlapped with the next forward against Q3VL_OVERLAP_UPDATE=0, every loss equal; (3) one stream
# of the 8B fp8 and bf16 on the new defaults. Each step only while the call has room.
source tools/gpu/call_lib.sh call2
Q3VL_OPS=linear,argmax unit_gpu 'BackendOps.*:DevInfer.*:Golden.*' 150
mv "$out/unit.log" "$out/unit_default.log"
left 60 && { Q3VL_GEMV_TMA=1 Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*' 60; mv "$out/unit.log" "$out/unit_tma1.log"; }
left 150 && {
  t1=$SECONDS
  timeout 170 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_overlap overlap > /dev/null 2>&1
  mkdir -p "$out/overlap" && tar xzf /tmp/tc_overlap/results.tgz -C "$out/overlap" 2>/dev/null
  say "overlap $((SECONDS - t1)) s: $(grep -hE 'PASS|FAIL|rc=' "$out/overlap/summary.txt" | tr '\n' ';')"; pack
}
left 80 && serve_one fp8 8bfp8 80
left 80 && serve_one bf16 8b 80
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
