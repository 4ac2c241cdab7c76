#!/usr/bin/env bash
# call 4 (eighteenth session): the head's attention (call 2's kernels, the dQ tile index as a shared function):
# bin/attn_check against the fp64 reference and timed; then the first case timed alternately with call 2's build.
source tools/gpu/call_lib.sh res4
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/attn.txt 2>&1
say "attn_check rc=$? $((SECONDS-t1)) s"; grep FAIL $out/attn.txt | head -5 >> $out/summary.txt; pack
for i in 1 2; do
  for v in attn_check_c2 attn_check; do
    timeout 60 /tmp/rt/bin/$v --no-checks --first 3 > $out/$v.$i.txt 2>&1
    say "$v $i rc=$?: $(grep -A3 '^case (median' $out/$v.$i.txt | tail -3 | awk '{printf "%s %s fwd %s bwd %s | ", $4, $6, $8, $12}')"
  done
done
say "done $((SECONDS-T0)) s"; pack
cut -c1-400 $out/summary.txt; grep -A11 "^case (median" $out/attn.txt
