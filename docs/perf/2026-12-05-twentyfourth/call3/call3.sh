#!/usr/bin/env bash
# call 3 (twenty-fourth session, an H200 only: the cut needs ~103 GiB): call 2's binaries; the 30B-A3B cut (6 layers,
# 1 x 4096 tokens) with the squares taken (default) and with Q3VL_GRAD_SQUARES=0, transformers beside them.
source tools/gpu/call_lib.sh res3
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if ((mib < 110000)); then say "skipped: the cut needs ~103 GiB, this GPU has $mib MiB"; pack; exit 0; fi
train_prof q30b input/bench_30b_a3b_gpu.deck 90 run.profile_top=0
Q3VL_GRAD_SQUARES=0 train_prof q30b_nosq input/bench_30b_a3b_gpu.deck 90 run.profile_top=0
hf_train hf30b 60 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
for n in q30b q30b_nosq; do ratio $n hf30b "$n: 30B-A3B x 6 layers, 1 x 4096 tokens"; done
prof_rows q30b q30b_nosq
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt
