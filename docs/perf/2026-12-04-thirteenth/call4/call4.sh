#!/usr/bin/env bash
# call 4 (thirteenth session), the head's binaries (609c152): serving with the vectorized elementwise kernels and the
# norms in row groups (qkv_to_cache through k_qk_norm_rope_vec): the 8B at 1 and 64 streams, the 30B-A3B at 1.
source tools/gpu/call_lib.sh res4
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  env CONC="$c" "$@" timeout $t bash tools/gpu/serve_checks.sh $q none /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run 8b 8b "1 64" 100
run 30b 30b 1 170
say "done $((SECONDS-T0)) s"; pack
grep -E "c=1 |c=64 |engine over|done" $out/summary.txt | cut -c1-260
