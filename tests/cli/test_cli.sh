#!/usr/bin/env bash
# The command line as a user meets it: version, help, unknown mode, bad decks and overrides give a clear
# message on stderr, printed once even with several ranks, and exit 1.
source "$(dirname "$0")/../lib.sh"

expect version 0 '^q3vl [0-9]+\.[0-9]+\.[0-9]+ \(git [0-9a-f]+' $q --version
expect help 0 'usage: q3vl MODE' $q --help
expect help-deck 0 'zero_stage \(int, default 3, range \[1, 3\]\)' $q help deck
expect no-args 2 'usage: q3vl MODE' $q
expect unknown-mode 1 "unknown mode 'trian' \(modes: .*check" $q trian

printf '[train]\nlr = 1e-4\nlrr = 2\n' >"$tmp/unknown.toml"
expect unknown-key 1 "unknown.toml:3:1: unknown key 'train.lrr' \(did you mean 'train.lr'\?\)" $q check "$tmp/unknown.toml"
printf '[parallel]\nzero_stage = 4\n' >"$tmp/range.toml"
expect out-of-range 1 "range.toml:2:14: parallel.zero_stage = 4 is out of range" $q check "$tmp/range.toml"
expect bad-override 1 "command line: 'train.steps=ten': train.steps expects an integer" $q check train.steps=ten
expect missing-deck 1 "cannot open deck '$tmp/none.toml'" $q check "$tmp/none.toml"
expect two-decks 1 "only one deck may be given" $q check "$tmp/range.toml" "$tmp/unknown.toml"
expect bad-flag 1 "mode check does not take the flag '--decode'" $q check --decode

# Several ranks: the error is printed once (by rank 0) and the exit code is still 1.
out=$(mpiexec -n 2 $q check "$tmp/range.toml" 2>&1); rc=$?
n=$(grep -c "is out of range" <<<"$out")
if [[ $rc -eq 1 && $n -eq 1 ]]; then pass "collective-error-once"; else bad "collective-error-once: rc=$rc, printed $n times: $out"; fi

# check passes on this machine and writes the bandwidth table; the resolved deck is echoed at the top.
out=$(mpiexec -n 2 $q check run.out_dir="$tmp/out" run.rank_logs=true 2>&1); rc=$?
if [[ $rc -eq 0 ]] && grep -q "check passed: 2 rank(s)" <<<"$out" && grep -q '^zero_stage = 3$' <<<"$out" &&
   grep -q 'busbw' <<<"$out" && [[ -s $tmp/out/rank-1.log ]] && grep -q '^Timing' <<<"$out" &&
   grep -qE 'offload rates, node of rank 0: host AdamW [0-9.]+ GB/s .*plan.host_gbs = [1-9][0-9]*$' <<<"$out"; then
  pass "check-2-ranks"
else
  bad "check-2-ranks: rc=$rc: $out"
fi
# check fails naming the rank and host that lacks a resource: more GPUs per node than any host has.
# The node is named once, by its first rank.
out=$(mpiexec -n 2 $q check runtime.gpus_per_node=4096 run.out_dir="$tmp/out" 2>&1); rc=$?
want="^ +rank 0 on $(hostname) \(and its 1 other rank\(s\) there\): [0-9]+ GPU\(s\) visible, runtime.gpus_per_node = 4096$"
if [[ $rc -eq 1 ]] && grep -q "check failed" <<<"$out" && grep -qE "$want" <<<"$out" &&
   ! grep -q "rank 1 on" <<<"$out"; then
  pass "check-missing-gpu"
else
  bad "check-missing-gpu: rc=$rc: $out"
fi

# Compute modes refuse what this machine cannot do (no GPU here; bf16 on the CPU) instead of silently running in fp32.
for kv in model.backend=cuda model.dtype=bf16; do
  out=$($q train "$kv" run.out_dir="$tmp/out" 2>&1); rc=$?
  if [[ $rc -ne 0 ]] && grep -q "error.*: ${kv%%=*} = \"" <<<"$out" && [[ ! -e $tmp/out/metrics.jsonl ]]; then
    pass "refuse-$kv"
  else
    bad "refuse-$kv: rc=$rc: $out"
  fi
done

# The suites' own numeric checks (tests/lib.sh) fail on NaN, Inf and a missing value: holds, and cmp_ckpt on two
# checkpoints bitwise equal with the same NaN.
! holds 'abs(x[0] - x[1]) <= 1' nan 1 && ! holds 'abs(x[0] - x[1]) <= 1' 1 -inf && ! holds 'x[0] >= 50' "" &&
  holds 'x[0] >= 50' 50 && pass "holds: NaN, Inf and a missing value fail" || bad "holds passed NaN, Inf or nothing"
$py -c "import h5py, numpy as np, sys
for p in sys.argv[1:]:
    with h5py.File(p, 'w') as f: f['model/w'] = np.array([1, np.nan], 'f4'); f['optim/exp_avg_sq/w'] = np.ones(2, 'f4')
" $tmp/nan1.h5 $tmp/nan2.h5
if out=$(cmp_ckpt $tmp/nan1.h5 $tmp/nan2.h5 0 2>&1); then bad "cmp_ckpt passed two checkpoints holding NaN"
elif grep -q "model/w: NaN or Inf" <<<"$out"; then pass "cmp_ckpt: NaN fails, bitwise equal or not"
else bad "cmp_ckpt: $out"; fi

finish
