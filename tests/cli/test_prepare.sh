#!/usr/bin/env bash
# `q3vl prepare` and `q3vl tokenize` as a user runs them: the same summary at 1, 2 and 4 ranks, a bad image fails
# naming the file, line and image (printed once), skip mode drops and counts, bad settings fail clearly.
# (Sample-by-sample equality across rank counts is tests/mpi/test_prepare.cpp.)
source "$(dirname "$0")/../lib.sh"
d=tests/data/prepare
small="prepare.min_pixels=1024 prepare.max_pixels=16384 prepare.min_side=3 prepare.shard_size=2"

summaries=()
for n in 1 2 4; do
  out=$(mpiexec -n $n $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/n$n" $small 2>&1); rc=$?
  line=$(grep '^prepare: ' <<<"$out")
  if [[ $rc -eq 0 && $(grep -c '^prepare: ' <<<"$out") -eq 1 && -s $tmp/n$n/index.json ]] &&
     grep -q "11 record(s) -> 11 sample(s) (.* 12 images) in .* shard(s); dropped 0$" <<<"$line"; then
    pass "prepare-np$n"
  else
    bad "prepare-np$n: rc=$rc: $out"
  fi
  summaries+=("${line% in *}")  # shard counts differ with the rank count; the rest must not
done
if [[ ${summaries[0]} == "${summaries[1]}" && ${summaries[0]} == "${summaries[2]}" ]]; then
  pass "same-summary-any-rank-count"
else
  bad "summaries differ: ${summaries[*]}"
fi

out=$(mpiexec -n 2 $q prepare prepare.input=$d/bad.jsonl prepare.output="$tmp/bad" $small 2>&1); rc=$?
n=$(grep -c "bad.jsonl:2: image 1 'img/corrupt.png': .*corrupt or truncated PNG" <<<"$out")
if [[ $rc -eq 1 && $n -eq 1 && ! -e $tmp/bad/index.json ]]; then pass "fail-names-bad-image"; else bad "fail-names-bad-image: rc=$rc n=$n: $out"; fi

expect skip-counts 0 'prepare: 9 record\(s\) -> 3 sample\(s\) .*; dropped 6 \(aspect ratio beyond 200:1 1, bad record 2, image too small 1, missing image 1, unreadable image 1\)' \
  mpiexec -n 4 $q prepare prepare.input=$d/bad.jsonl prepare.output="$tmp/skip" prepare.on_error=skip $small
expect missing-input 1 "prepare.input '$tmp/none.jsonl' does not exist; it must be a file" \
  $q prepare prepare.input="$tmp/none.jsonl" prepare.output="$tmp/x"
expect required-key 1 "prepare.output" $q prepare prepare.input=$d/train.jsonl
expect bad-on-error 1 "prepare.on_error" $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/x" prepare.on_error=maybe

expect tokenize 0 '^\[151644, ?872, ?198\]$' bash -c "echo '\"<|im_start|>user\\n\"' | $q tokenize"
expect detokenize 0 '^"<\|im_end\|>\\n"$' bash -c "echo '[151645, 198]' | $q tokenize --decode"

finish
