#!/usr/bin/env bash
# call H (written in the fortieth session, which was lent no device; either GPU kind). The pack: main (with
# Q3VL_UPDATE_HOLD, 1ab2cfc) + docs/perf/2026-12-08-fortieth/grouped_sm90.diff applied, built with
# `make FFMPEG=0 NVFLAGS_EXTRA=--no-compress bin/q3vl bin/unit_tests bin/moe_bench`, those three packed into devpack.
# First the grouped GEMM's 2-CTA clusters (Q3VL_GROUPED_CLUSTER=1) and DW's epilogue by TMA tensor stores
# (Q3VL_GROUPED_DW_TMA=1), never run on a GPU: moe_bench (paths new, clu, tma) beside a dense GEMM under a timeout
# against a hang; the op table's grouped cases with each knob), then the
# update in the backward's placement on the 30B-A3B cut (3 layers on an H100, 6 on an H200) beside transformers: the
# default, held past the experts, below the model's priority; the cut with the clusters if they passed; part inbwd.
source tools/gpu/call_lib.sh callH
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=3; [[ $mem -gt 100000 ]] && L=6
t1=$SECONDS; timeout 120 /tmp/rt/bin/moe_bench 20 > "$out/moe_bench.txt" 2>&1; mb=$?
say "moe_bench rc=$mb $((SECONDS - t1)) s"; grep -E '^\|' "$out/moe_bench.txt" >> "$out/summary.txt"; pack
f='BackendOps.Bf16:BackendOps.Fp16'
Q3VL_GROUPED_CLUSTER=1 Q3VL_OPS=grouped_linear unit_gpu "$f" 90 unit_clu; uc=$?    # the clusters
Q3VL_GROUPED_DW_TMA=1 Q3VL_OPS=grouped_linear unit_gpu "$f" 90 unit_dwtma; ut=$?   # DW by tensor stores
say "GPU memory $mem MiB: the 30B-A3B cut at $L layers"
ub="optim.clip=0 optim.update_in_backward=true"
d=input/bench_30b_a3b_gpu.deck
train_prof q30 $d 100 run.profile_top=0 model.text_layers=$L
hf_train hf30 150 --preset 30B-A3B --text-layers $L --batch 1 --seq 4096
ratio q30 hf30 "30B-A3B x $L layers, the default"
Q3VL_UPDATE_HOLD=experts train_prof q30hold $d 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30hold hf30 "30B-A3B x $L layers, the update in the backward held past the experts"
if [[ $mb == 0 && ( $uc == 0 || $ut == 0 ) ]] && left 100; then  # each knob that passed its op table
  knobs=(); [[ $uc == 0 ]] && knobs+=(Q3VL_GROUPED_CLUSTER=1); [[ $ut == 0 ]] && knobs+=(Q3VL_GROUPED_DW_TMA=1)
  export "${knobs[@]}"
  train_prof q30clu $d 100 run.profile_top=0 model.text_layers=$L &&
    ratio q30clu hf30 "30B-A3B x $L layers, the default, with ${knobs[*]}"
  unset Q3VL_GROUPED_CLUSTER Q3VL_GROUPED_DW_TMA
fi
left 100 && Q3VL_UPDATE_PRIO=low train_prof q30low $d 100 run.profile_top=0 model.text_layers=$L $ub &&
  ratio q30low hf30 "30B-A3B x $L layers, the update in the backward below the model's priority"
prof_rows q30 q30hold q30clu q30low
for n in q30 q30hold q30clu q30low; do say "$n: $(grep -E '^ +grouped_linear_(fwd|bwd)' "$out/${n}_profile.txt" 2>/dev/null | tr -s ' ' | cut -d' ' -f2-6 | tr '\n' ';')"; done
say "$(grep -h 'units held until' "$out/q30hold.log" | head -1)"
if left 100; then
  t1=$SECONDS
  timeout 140 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc inbwd > /dev/null 2>&1
  mkdir -p "$out/tc"; tar xzf /tmp/tc/results.tgz -C "$out/tc" 2>/dev/null
  say "train_checks inbwd $((SECONDS - t1)) s:"; grep -E "PASS|FAIL|ubnan|ubmoe|ubhold|rc=[1-9]" "$out/tc/summary.txt" >> "$out/summary.txt"; pack
fi
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
