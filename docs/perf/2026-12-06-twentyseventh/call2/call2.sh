#!/usr/bin/env bash
# call 2 (twenty-seventh session): (1) train_checks.sh part overlap: the optimizer update overlapped with the next
# forward against Q3VL_OVERLAP_UPDATE=0, every loss equal; (2) the 30B-A3B cut (input/bench_30b_a3b_gpu.deck: 1 x 4096
# tokens a step) with the overlap (Q3VL_OVERLAP_UPDATE=1) and with Q3VL_OVERLAP_UPDATE=0, transformers beside them. Each step
# only while the call has room.
source tools/gpu/call_lib.sh call2
t1=$SECONDS
timeout 170 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_overlap overlap > /dev/null 2>&1
mkdir -p "$out/overlap" && tar xzf /tmp/tc_overlap/results.tgz -C "$out/overlap" 2>/dev/null
say "overlap $((SECONDS - t1)) s: $(grep -hE 'PASS|FAIL|rc=' "$out/overlap/summary.txt" | tr '\n' ';')"; pack
left 100 && Q3VL_OVERLAP_UPDATE=1 train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
left 100 && Q3VL_OVERLAP_UPDATE=0 train_prof q30b_off input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
left 120 && hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
[[ -f $out/hf30b.jsonl ]] && { ratio q30b hf30b "30B-A3B x 6, overlapped update"; ratio q30b_off hf30b "30B-A3B x 6, Q3VL_OVERLAP_UPDATE=0"; }
prof_rows q30b q30b_off
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
