#!/usr/bin/env bash
# call 2h (twenty-seventh session; for an H100, where the 30B-A3B cut's 6 layers of fp32 AdamW state do not fit):
# (1) train_checks.sh part overlap: the optimizer update overlapped with the next forward against
# Q3VL_OVERLAP_UPDATE=0, every loss equal; (2) the 30B-A3B cut to 3 decoder layers, with the overlap and without;
# (3) one stream of the 8B bf16 and fp8 on the new GEMV defaults, the bf16 also with Q3VL_GEMV_TMA=1.
# Each step only while the call has room.
source tools/gpu/call_lib.sh call2h
t1=$SECONDS
timeout 170 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_overlap overlap > /dev/null 2>&1
mkdir -p "$out/overlap" && tar xzf /tmp/tc_overlap/results.tgz -C "$out/overlap" 2>/dev/null
say "overlap $((SECONDS - t1)) s: $(grep -hE 'PASS|FAIL|rc=' "$out/overlap/summary.txt" | tr '\n' ';')"; pack
left 90 && Q3VL_OVERLAP_UPDATE=1 train_prof q30b3 input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 model.text_layers=3
left 90 && Q3VL_OVERLAP_UPDATE=0 train_prof q30b3_off input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 model.text_layers=3
prof_rows q30b3 q30b3_off
left 60 && serve_one bf16 8b 60
left 60 && serve_one fp8 8bfp8 60
left 60 && serve_one bf16_tma1 8b 60 Q3VL_GEMV_TMA=1
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
