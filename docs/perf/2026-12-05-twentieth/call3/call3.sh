#!/usr/bin/env bash
# call 3 (twentieth session): grouped_ws's DW in 128 x 128 tiles leaving through shared memory by bulk copies (written,
# or added in L2 by cp.reduce.async.bulk): the op table's grouped cases (Q3VL_OPS), the MoE model tests, moe_bench with
# it and without (Q3VL_GROUPED_WS=0), then the 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh res3
Q3VL_OPS=grouped,moe unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:BackendOps.Fp16:DevModel.*:DevLayers.*' 150
for ws in 1 0; do
  t1=$SECONDS; Q3VL_GROUPED_WS=$ws timeout 60 /tmp/rt/bin/moe_bench > $out/moe_bench_ws$ws.txt 2>&1
  say "moe_bench ws=$ws rc=$? $((SECONDS-t1)) s"; pack
done
vs_hf 30b
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt; tail -11 $out/moe_bench_ws1.txt; grep -E "grouped|left out|within" $out/unit.log | grep -v " ok$" | head
