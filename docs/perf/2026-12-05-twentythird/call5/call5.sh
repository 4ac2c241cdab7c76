#!/usr/bin/env bash
# call 5 (twenty-third session, an H200 only: the cut needs ~103 GiB): the 30B-A3B cut (6 layers, 1 x 4096 tokens)
# at the head's code beside transformers, in the session's last 290 s of device time.
source tools/gpu/call_lib.sh res5
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if ((mib < 110000)); then say "q30b skipped: the cut needs ~103 GiB, this GPU has $mib MiB"; pack; exit 0; fi
train_prof q30b input/bench_30b_a3b_gpu.deck 80 run.profile_top=0
hf_train hf30b 95 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack; cat $out/summary.txt | cut -c1-300
