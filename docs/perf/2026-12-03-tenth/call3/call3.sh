#!/usr/bin/env bash
# call 3 (2026-12-03, tenth session), q3vl at m10 head (call 2 + the SwiGLU read through only for <= 8 short rows, adamw
# writing the bf16 parameter copy, sum_squares in 16-byte loads): the GPU suites, the 30B-A3B served (1 and 64
# streams), the 30B-A3B training cut (6 layers) profiled at step 3 against transformers, the 8B fp8 at 1 stream, the
# 2B against transformers.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res3 final=$OUT
rm -rf $out /tmp/results /tmp/sc_* /tmp/runs /tmp/tc_*; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
Q3VL_REQUIRE_GPU=1 timeout 170 /tmp/rt/bin/unit_tests --gtest_filter='BackendOps.*:DevInfer.*:DevModel.*:DevLayers.*:Golden.*:Profile.*' > $out/unit.log 2>&1
say "unit rc=$? $((SECONDS-T0)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/unit.log | tr '\n' ' ')"
grep -E "^\[  FAILED|FAIL$" $out/unit.log | head -20 >> $out/summary.txt; pack
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 30b 30b "1 64" 125 PROFILE=2 PROFILE_ROWS=1
timeout 80 $q train input/bench_30b_a3b_gpu.deck checkpoint.every=0 run.profile=true run.profile_step=3 \
  run.out_dir=/tmp/runs/moe > $out/moe_q3vl.log 2>&1
say "moe q3vl rc=$? $((SECONDS-T0)) s (killed in its final checkpoint)"; cp /tmp/runs/moe/metrics.jsonl $out/moe_q3vl.jsonl
rm -rf /tmp/runs; pack
rem=$((300 - SECONDS + T0))
if ((rem > 30)); then
  timeout $rem python3 tools/gpu/hf_train_baseline.py --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096 \
    --out "$out/moe_hf.jsonl" > "$out/moe_hf.log" 2>&1
  say "moe transformers: rc=$? $((SECONDS-T0)) s $(tail -1 "$out/moe_hf.log")"
  python3 - "$out/moe_q3vl.jsonl" "$out/moe_hf.jsonl" >> "$out/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
q, h = ([json.loads(l) for l in open(f) if "tokens_per_s" in l][2:] for f in sys.argv[1:3])
tq, th = (statistics.median(x["tokens_per_s"] for x in r) for r in (q, h))
mq, mh = (statistics.median(x["mfu"] for x in r) for r in (q, h))
print(f"30B-A3B x 6 layers, 1 x 4096 tokens, steps 3-8: q3vl {tq:.0f} tokens/s (mfu {mq:.3f}), transformers {th:.0f} "
      f"(mfu {mh:.3f}): {tq / th:.2f}x")
PY
  pack
fi
rem=$((300 - SECONDS + T0)); ((rem > 45)) && run 8bfp8 8bfp8 1 $rem
rem=$((300 - SECONDS + T0))
((rem > 100)) && timeout $rem bash tools/gpu/train_checks.sh $q none /tmp/tc_hft hftrain > /dev/null 2>&1
mkdir -p $out/hftrain; tar xzf /tmp/tc_hft/results.tgz -C $out/hftrain 2>/dev/null; grep -E 'hftrain|2B' /tmp/tc_hft/summary.txt >> $out/summary.txt
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
