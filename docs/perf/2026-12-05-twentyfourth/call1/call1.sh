#!/usr/bin/env bash
# call 1 (twenty-fourth session): the experts' gradient squares taken in the grouped DW epilogue (dev::SumSq).
# (1) The GPU suites: the op table's grouped cases (with the new written-dW-with-squares cases, one with a planted
#     Inf), DevModel (GradSquaresAreTakenOnCuda among them), DevLayers, Profile.
# (2) moe_bench: DW= against DW=sq (the epilogue's cost) and the fused sum against sum_squares over the reference.
# (3) The 30B-A3B cut (an H200: ~103 GiB; on an 80 GB card the same cut at 3 layers, q3vl only): the squares taken
#     (default) against Q3VL_GRAD_SQUARES=0 (the norm reads every gradient), and Q3VL_ADAMW_WIDE=1 (two float4s of
#     each array a thread in flight, evict-first stores) on top; transformers beside them on an H200.
source tools/gpu/call_lib.sh res1
left() { (( 560 - (SECONDS - T0) > $1 )); }
Q3VL_OPS=grouped unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:DevModel.*:DevLayers.*:Profile.*' 200
t1=$SECONDS; timeout 90 /tmp/rt/bin/moe_bench > $out/moe_bench.txt 2>&1; say "moe_bench rc=$? $((SECONDS-t1)) s"; pack
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
deck=input/bench_30b_a3b_gpu.deck cut=()
if ((mib < 110000)); then cut=(model.text_layers=3); say "an 80 GB card ($mib MiB): the cut at 3 layers, no transformers"; fi
left 100 && train_prof q30b $deck 90 run.profile_top=0 "${cut[@]}"
left 100 && Q3VL_GRAD_SQUARES=0 train_prof q30b_nosq $deck 90 run.profile_top=0 "${cut[@]}"
left 100 && Q3VL_ADAMW_WIDE=1 train_prof q30b_wide $deck 90 run.profile_top=0 "${cut[@]}"
if ((mib >= 110000)) && left 50; then
  hf_train hf30b 60 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  for n in q30b q30b_nosq q30b_wide; do ratio $n hf30b "$n: 30B-A3B x 6 layers, 1 x 4096 tokens"; done
fi
for n in q30b q30b_nosq q30b_wide; do
  say "$n: $(grep -E '^ +(adamw|sum_squares|grouped_linear_bwd|layernorm_bwd)' $out/${n}_profile.txt | tr -s ' ' | cut -d' ' -f2-6 | tr '\n' ';')"
  say "$n: $(head -1 $out/${n}_profile.txt); $(grep -m1 'gradient norm:' $out/$n.log)"
done
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; head -16 $out/moe_bench.txt
grep -E "grouped|left out|within" $out/unit.log | grep -v " ok$" | head
