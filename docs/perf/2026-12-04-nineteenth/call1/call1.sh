#!/usr/bin/env bash
# call 1 (nineteenth session): the LM head and the loss in the backward (each chunk's logits once a micro-step);
# bin/attn_check and PyTorch SDPA (tools/gpu/sdpa_bench.py) at the same shapes in one call; the GPU suites; the 2B
# against transformers; the 2B again with 2048-row head chunks (Q3VL_HEAD_ROWS).
source tools/gpu/call_lib.sh res1
t1=$SECONDS; timeout 120 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
t1=$SECONDS; env -u LD_LIBRARY_PATH timeout 120 python3 tools/gpu/sdpa_bench.py --out $out/sdpa.jsonl > $out/sdpa.txt 2>&1
say "sdpa_bench rc=$? $((SECONDS-t1)) s"; pack
vs_hf 2b
Q3VL_HEAD_ROWS=2048 train_prof q2b_h2048 input/bench_2b_gpu.deck 120 run.profile_top=0
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 170
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; cat $out/sdpa.txt | tail -30; head -14 $out/q2b_profile.txt
