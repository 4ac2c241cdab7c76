#!/usr/bin/env bash
# `q3vl eval` end to end on a golden case: the written loss, logits and grads equal transformers' (the
# detailed comparison of every tensor is tests/unit/test_golden.cpp); bad inputs fail clearly.
source "$(dirname "$0")/../lib.sh"
g=tests/data/golden/moe
scalar() { h5dump -m '%.17g' -d "$2" "$1" | awk '/\(0\)/ {print $2}'; }

out=$(mpiexec -n 2 $q eval model.hf=$g/model eval.batch=$g/batch.h5 eval.output=$tmp/out.h5 eval.grads=true \
      eval.router_aux_loss=true 2>&1); rc=$?
if [[ $rc -ne 0 ]]; then bad "eval ran: rc=$rc: $out"; else
  got=$(scalar $tmp/out.h5 /loss) want=$(scalar $g/expected.h5 /loss)
  if holds 'abs(x[0] - x[1]) <= 2e-6 * abs(x[1])' "$got" "$want"; then  # test_golden.cpp's fp32 bound
    pass "loss $got equals transformers' $want"
  else bad "loss $got vs transformers' $want"; fi
  n=$(h5ls -r $tmp/out.h5 | grep -c '^/grads/') m=$(h5ls -r $g/expected.h5 | grep -c '^/grads/')
  [[ $n -eq $m && $n -gt 10 ]] && pass "$n gradients written" || bad "$n gradients written, transformers has $m"
  grep -q 'logits *Dataset {2, 28, 256}' <<<"$(h5ls $tmp/out.h5)" && pass "logits [2,28,256]" || bad "logits shape: $(h5ls $tmp/out.h5)"
  [[ -z $(ls $tmp/*.partial 2>/dev/null) ]] && pass "no partial output left" || bad "partial output left behind"
fi

expect no-model 1 "eval needs a model: set model.hf" $q eval eval.batch=$g/batch.h5 eval.output=$tmp/o.h5
expect no-batch-key 1 "missing required key 'eval.batch'" $q eval model.hf=$g/model eval.output=$tmp/o.h5
expect missing-batch 1 "$tmp/none.h5" $q eval model.hf=$g/model eval.batch=$tmp/none.h5 eval.output=$tmp/o.h5
expect missing-model-dir 1 "$tmp/nomodel" $q eval model.hf=$tmp/nomodel eval.batch=$g/batch.h5 eval.output=$tmp/o.h5
# A model directory whose weights lack a tensor: the message names it.
mkdir -p $tmp/broken && cp $g/model/config.json $tmp/broken/ && printf '{}' >$tmp/broken/model.safetensors.index.json
expect broken-model 1 "safetensors|missing|model.safetensors" $q eval model.hf=$tmp/broken eval.batch=$g/batch.h5 eval.output=$tmp/o.h5

finish
