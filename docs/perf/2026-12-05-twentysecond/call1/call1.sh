#!/usr/bin/env bash
# call 1 (twenty-second session): two A/Bs of the grouped expert GEMM (grouped_ws): DW written from registers
# (Q3VL_DW_REGS=1) against the shared-memory epilogue, and FWD/DX's second consumer issuing no wgmma on an expert's last
# M tile of <= 64 rows (Q3VL_WS_SKIP=1; unset: the previous code). The op table's grouped cases and the MoE model
# suites with both on, moe_bench three ways, then the 30B-A3B cut three ways beside transformers.
source tools/gpu/call_lib.sh res1
Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1 Q3VL_OPS=grouped,moe unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:BackendOps.Fp16:DevModel.*:DevLayers.*' 150
mb() {  # NAME ENV...
  local n=$1 t1=$SECONDS; shift
  env "$@" timeout 60 /tmp/rt/bin/moe_bench > $out/moe_bench_$n.txt 2>&1
  say "moe_bench $n ($*) rc=$? $((SECONDS-t1)) s"; pack
}
mb new Q3VL_WS_SKIP=1
mb regs Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1
mb old Q3VL_WS_SKIP=0
Q3VL_WS_SKIP=1 train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
hf_train hf30b 150 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens (skip)"
Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1 train_prof q30b_regs input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
ratio q30b_regs hf30b "30B-A3B x 6 layers, 1 x 4096 tokens (skip, DW from registers)"
Q3VL_WS_SKIP=0 train_prof q30b_old input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
ratio q30b_old hf30b "30B-A3B x 6 layers, 1 x 4096 tokens (previous code)"
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt; for n in new regs old; do grep -E "^\| (gate_up|down)" $out/moe_bench_$n.txt | cut -d'|' -f2-4,6 | tr '\n' ';'; echo; done
grep -E "grouped|left out|within" $out/unit.log | grep -v " ok$" | head
