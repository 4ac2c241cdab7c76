#!/usr/bin/env bash
# call 5 (twenty-seventh session; little device time left): the overlapped update's first GPU run, in short:
# (1) the demo model, 20 steps in bf16 on 1 rank, Q3VL_OVERLAP_UPDATE=1 against =0 (every loss equal);
# (2) the 30B-A3B cut (6 layers on an H200, 3 on an H100, whose memory the 6 layers' fp32 state exceeds), 6 steps,
# with the overlap and without; (3) the demo on 2 ranks sharing the GPU (ZeRO-3 over NCCL), both ways.
source tools/gpu/call_lib.sh call5
L=6; (( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) < 100000 )) && L=3
tc() { timeout "$1" bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_$2 "$3" > /dev/null 2>&1
       mkdir -p "$out/$2" && tar xzf /tmp/tc_$2/results.tgz -C "$out/$2" 2>/dev/null
       say "$2: $(grep -hE 'PASS|FAIL|rc=' "$out/$2/summary.txt" | tr '\n' ';')"; pack; }
tc 90 ov1 overlap1
Q3VL_OVERLAP_UPDATE=1 train_prof q30b input/bench_30b_a3b_gpu.deck 95 run.profile_top=0 model.text_layers=$L train.steps=6
Q3VL_OVERLAP_UPDATE=0 train_prof q30b_off input/bench_30b_a3b_gpu.deck 95 run.profile_top=0 model.text_layers=$L train.steps=6
prof_rows q30b q30b_off
left 60 && tc 80 ov2 overlap2
say "done $((SECONDS - T0)) s ($L layers)"; pack
cat "$out/summary.txt"
