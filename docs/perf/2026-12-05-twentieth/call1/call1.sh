#!/usr/bin/env bash
# call 1 (twentieth session): the nineteenth session's untested work on the GPU (the LM head once a micro-step, q/k/v
# as one GEMM in training): the GPU suites, the 2B and 30B-A3B cut beside transformers, the head's chunk rows at 2048,
# then bin/attn_check beside PyTorch SDPA (tools/gpu/sdpa_bench.py's first run).
source tools/gpu/call_lib.sh res1
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
vs_hf 2b
Q3VL_HEAD_ROWS=2048 train_prof q2b_h2048 input/bench_2b_gpu.deck 100 run.profile_top=0
ratio q2b_h2048 hf2b "2B, head chunks of 2048 rows"
t1=$SECONDS; timeout 100 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
t1=$SECONDS; env -u LD_LIBRARY_PATH timeout 60 python3 tools/gpu/sdpa_bench.py --out $out/sdpa.jsonl > $out/sdpa.txt 2>&1
say "sdpa_bench rc=$? $((SECONDS-t1)) s"; pack
vs_hf 30b
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt; tail -12 $out/sdpa.txt
