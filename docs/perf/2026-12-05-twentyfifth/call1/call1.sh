#!/usr/bin/env bash
# call 1 (twenty-fifth session): the TMA-fed decode GEMV (src/tensor/cuda/gemv_tma.cuh).
# (1) correctness: the op table's linear cases with Q3VL_GEMV_TMA=1 (gemv() takes the TMA GEMV for 8-bit weights
#     and for experts of up to 8 rows) and Q3VL_GEMV_TMA_DENSE=1 (linear_fwd's bf16 one to 8 rows through it too),
#     DevInfer.* and Golden.* likewise;
# (2) gemv_bench: the register ring against the TMA GEMV at five settings, cuBLASLt bf16 beside them;
# (3) one 8B fp8 stream with Q3VL_GEMV_TMA=1, then without (the ring, the default). Each step only while the call has room.
source tools/gpu/call_lib.sh call1
export Q3VL_GEMV_TMA=1 Q3VL_GEMV_TMA_DENSE=1
Q3VL_OPS=linear unit_gpu 'BackendOps.*:DevInfer.*:Golden.*' 150
mv "$out/unit.log" "$out/unit_tma.log"
unset Q3VL_GEMV_TMA Q3VL_GEMV_TMA_DENSE
t1=$SECONDS
timeout 150 /tmp/rt/bin/gemv_bench 60 > "$out/gemv_bench.txt" 2> "$out/gemv_bench.err"
say "gemv_bench rc=$? $((SECONDS - t1)) s"; pack
left 80 && serve_one fp8_tma 8bfp8 80 Q3VL_GEMV_TMA=1
left 80 && serve_one fp8_ring 8bfp8 80
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"; grep -E "FAIL|^\| 8B (qkv|o_proj|gate_up|down|lm_head) \| [0-9>-]+ \| (fp8|bf16) \| 1 " "$out/gemv_bench.txt" | cut -c1-400
