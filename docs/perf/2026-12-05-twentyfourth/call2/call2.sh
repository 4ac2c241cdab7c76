#!/usr/bin/env bash
# call 2 (twenty-fourth session, an H200: the cut needs ~103 GiB): the head's code (call 1's squares; the wide AdamW
# dropped; the norms' backward in at least min(256, N / R) chunks).
# (1) The GPU suites: the op table's grouped and norm cases, DevModel, DevLayers, Profile, the goldens on CUDA.
# (2) The 30B-A3B cut (6 layers, 1 x 4096 tokens): the squares taken (default) and Q3VL_GRAD_SQUARES=0, transformers
#     beside them.
source tools/gpu/call_lib.sh res2
left() { (( 560 - (SECONDS - T0) > $1 )); }
Q3VL_OPS=grouped,norm unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:BackendOps.Fp16:DevModel.*:DevLayers.*:Profile.*:Golden.*' 220
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
cut=()
if ((mib < 110000)); then cut=(model.text_layers=3); say "an 80 GB card ($mib MiB): the cut at 3 layers, no transformers"; fi
left 100 && train_prof q30b input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 "${cut[@]}"
left 100 && Q3VL_GRAD_SQUARES=0 train_prof q30b_nosq input/bench_30b_a3b_gpu.deck 90 run.profile_top=0 "${cut[@]}"
if ((mib >= 110000)) && left 50; then
  hf_train hf30b 60 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  for n in q30b q30b_nosq; do ratio $n hf30b "$n: 30B-A3B x 6 layers, 1 x 4096 tokens"; done
fi
for n in q30b q30b_nosq; do
  say "$n: $(grep -E '^ +(adamw|sum_squares|grouped_linear_bwd|layernorm_bwd)' $out/${n}_profile.txt | tr -s ' ' | cut -d' ' -f2-6 | tr '\n' ';')"
  say "$n: $(head -1 $out/${n}_profile.txt); $(grep -m1 'gradient norm:' $out/$n.log)"
done
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt
grep -E "left out|within" $out/unit.log | head; grep -E " FAIL$" $out/unit.log | head
