#!/usr/bin/env bash
# `q3vl eval` end to end on a golden case: the written loss, logits and grads equal transformers' (the
# detailed comparison of every tensor is tests/unit/test_golden.cpp); bad inputs fail clearly.
set -uo pipefail
cd "$(dirname "$0")/../.."
q=bin/q3vl
g=tests/data/golden/moe
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=0 passes=0
ok() { echo "ok: $1"; passes=$((passes + 1)); }
bad() { echo "FAIL: $1"; fails=$((fails + 1)); }
scalar() { h5dump -m '%.17g' -d "$2" "$1" | awk '/\(0\)/ {print $2}'; }

out=$(mpiexec -n 2 $q eval model.hf=$g/model eval.batch=$g/batch.h5 eval.output=$tmp/out.h5 eval.grads=true \
      eval.router_aux_loss=true 2>&1); rc=$?
if [[ $rc -ne 0 ]]; then bad "eval ran: rc=$rc: $out"; else
  got=$(scalar $tmp/out.h5 /loss) want=$(scalar $g/expected.h5 /loss)
  if awk -v a="$got" -v b="$want" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * b) }'; then
    ok "loss $got equals transformers' $want"
  else bad "loss $got vs transformers' $want"; fi
  n=$(h5ls -r $tmp/out.h5 | grep -c '^/grads/') m=$(h5ls -r $g/expected.h5 | grep -c '^/grads/')
  [[ $n -eq $m && $n -gt 10 ]] && ok "$n gradients written" || bad "$n gradients written, transformers has $m"
  h5ls $tmp/out.h5 | grep -q 'logits *Dataset {2, 28, 256}' && ok "logits [2,28,256]" || bad "logits shape: $(h5ls $tmp/out.h5)"
  [[ -z $(ls $tmp/*.partial 2>/dev/null) ]] && ok "no partial output left" || bad "partial output left behind"
fi

# expect NAME PATTERN CMD...: exit 1 and a message matching PATTERN.
expect() {
  local name=$1 pat=$2; shift 2
  local o rc; o=$("$@" 2>&1); rc=$?
  [[ $rc -eq 1 ]] && grep -qE -- "$pat" <<<"$o" && ok "$name" || bad "$name: rc=$rc: $o"
}
expect no-model "eval needs a model: set model.hf" $q eval eval.batch=$g/batch.h5 eval.output=$tmp/o.h5
expect no-batch-key "missing required key 'eval.batch'" $q eval model.hf=$g/model eval.output=$tmp/o.h5
expect missing-batch "$tmp/none.h5" $q eval model.hf=$g/model eval.batch=$tmp/none.h5 eval.output=$tmp/o.h5
expect missing-model-dir "$tmp/nomodel" $q eval model.hf=$tmp/nomodel eval.batch=$g/batch.h5 eval.output=$tmp/o.h5
# A model directory whose weights lack a tensor: the message names it.
mkdir -p $tmp/broken && cp $g/model/config.json $tmp/broken/ && printf '{}' >$tmp/broken/model.safetensors.index.json
expect broken-model "safetensors|missing|model.safetensors" $q eval model.hf=$tmp/broken eval.batch=$g/batch.h5 eval.output=$tmp/o.h5

echo "$passes passed, $fails failed"
exit $((fails > 0))
