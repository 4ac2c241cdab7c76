#!/usr/bin/env bash
# call 2 (twentieth session): the grouped expert GEMM warp-specialized and persistent (TMA producer, two wgmma
# consumers; moe_sm90.cu's grouped_ws): the GPU suites (the op table's grouped cases against the CPU), bin/moe_bench
# with it and without (Q3VL_GROUPED_WS=0: call 1's kernel) in one call, then the 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh res2
unit_gpu 'BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:DevVision.*:Golden.*:Profile.*' 200
for ws in 1 0 1; do
  t1=$SECONDS; Q3VL_GROUPED_WS=$ws timeout 60 /tmp/rt/bin/moe_bench > $out/moe_bench_ws$ws.txt 2>&1
  say "moe_bench ws=$ws rc=$? $((SECONDS-t1)) s"; pack
done
vs_hf 30b
Q3VL_GROUPED_WS=0 train_prof q30b_old input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
ratio q30b_old hf30b "30B-A3B x 6 layers, call 1's grouped GEMM"
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt; cat $out/moe_bench_ws1.txt | tail -20; tail -12 $out/moe_bench_ws0.txt
