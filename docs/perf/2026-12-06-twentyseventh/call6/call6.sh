#!/usr/bin/env bash
# call 6 (twenty-seventh session; ~4 minutes of device time left): the overlapped update's correctness alone:
# train_checks.sh part overlap1 (the demo model, 20 steps in bf16 on 1 rank, Q3VL_OVERLAP_UPDATE=1 against =0, every
# loss equal), then overlap2 (the same in fp32 on 2 ranks sharing the GPU, ZeRO-3 over NCCL).
source tools/gpu/call_lib.sh call6
tc() { timeout "$1" bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_$2 "$3" > /dev/null 2>&1
       mkdir -p "$out/$2" && tar xzf /tmp/tc_$2/results.tgz -C "$out/$2" 2>/dev/null
       say "$2: $(grep -hE 'PASS|FAIL|rc=' "$out/$2/summary.txt" | tr '\n' ';')"; pack; }
tc 90 ov1 overlap1
tc 80 ov2 overlap2
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
