#!/usr/bin/env bash
# call 4 (2026-12-03, twelfth session), the head's binaries (446d4cc): the 8B at 64 streams again (run-to-run),
# transformers' generate() at batch 64 in the same call, the 30B-A3B's one stream with a 16-block routing cluster
# (Q3VL_ROUTE_CLUSTER=16) against call 3's 8.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
q=/tmp/rt/bin/q3vl out=/tmp/res4 final=$OUT
rm -rf $out /tmp/results /tmp/sc_* /tmp/runs /tmp/tc_*; mkdir -p $out  # a reused machine keeps /tmp
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  rm -rf /tmp/results
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 8b 8b "64 64" 90
t1=$SECONDS
env -u LD_LIBRARY_PATH timeout 150 python3 tools/gpu/hf_serve_baseline.py --preset 8B --batch 64 > $out/hf64.txt 2> $out/hf64.err
say "hf64 rc=$? $((SECONDS-t1)) s"; cat $out/hf64.txt >> $out/summary.txt; tail -2 $out/hf64.err >> $out/summary.txt; pack
rem=$((560 - SECONDS + T0)); ((rem > 110)) && run 30bc16 30b 1 $((rem - 5)) Q3VL_ROUTE_CLUSTER=16
say "done $((SECONDS-T0)) s"; pack
grep -E "c=1 |c=64 |engine over|hf64|transformers|done" $out/summary.txt | cut -c1-220
