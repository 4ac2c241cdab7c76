#!/usr/bin/env bash
# call 4 (seventeenth session): the head's code (2c9f70f: the dQ tiles and the TMA loads; call 3's pairs not merged):
# bin/attn_check against the fp64 reference and timed; the 2B (issue 30's shape) and the 30B-A3B cut, each against
# transformers in the same call. (The GPU suites ran on the same kernels in call 2: 53 of 53.)
source tools/gpu/call_lib.sh res4
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
hf_train hf2b 200
ratio q2b hf2b "2B, 4 x 4096 tokens a step"
train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; head -14 $out/q2b_profile.txt
