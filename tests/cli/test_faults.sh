#!/usr/bin/env bash
# Faults a user meets (issue 22), one group of checks per numbered case, each failing before the fix:
#  1 a stopped rank (SIGSTOP) in forward, in backward, during a checkpoint write, or at any time, ends a 4-rank
#    job within runtime.timeout + a few seconds naming the rank and the step; the checkpoint before it verifies;
#    SIGTERM still ends a job whose rank is stopped;
#  2 a failed prepare leaves the dataset in its output folder as it was; one is replaced only with overwrite;
#  3 a folder given where a file is expected (prepare.input, generate.prompts, the deck) is an error;
#  4 an unwritable checkpoint.dir or run.out_dir is found at start-up, before any step;
#  5 a STOP file writes a checkpoint and exits 3;
#  6 a shard damaged after prepare (same size) is refused naming it;
#  7 samples without supervised tokens are counted; an empty input or one without any is an error;
#  8 clearer messages: auto-resume after a damaged newest checkpoint, an override without a key, no MPICH abort
#    noise after a single-rank error;
#  9 (issue 33) a fresh run into a folder of another run's checkpoints is refused, or moves them aside with
#    checkpoint.overwrite, and then resumes as its own run; a newest checkpoint whose numbers fail their checksums
#    is skipped with a warning naming it, and the run resumes from the one before.
# And no existing dataset, checkpoint or output file is changed by any failed command here.
source "$(dirname "$0")/../lib.sh"
d=tests/data/prepare
small="prepare.min_pixels=1024 prepare.max_pixels=16384 prepare.min_side=3 prepare.shard_size=4"
# The tiny preset, short: a step takes well under a second on shared cores.
tiny=(input/train_tiny.deck data.seq_len=64 train.global_batch=4 train.micro_batch=1 train.steps=4
      checkpoint.every=2 runtime.timeout=5 run.timing=false)
limit=15000  # ms from a rank's stop to the end of the job: runtime.timeout = 5 s, a few seconds for MPI_Abort
t_suite=$SECONDS
case_() { echo "== case $1 (at $((SECONDS - t_suite)) s)"; }

# Files that every failed command below must leave alone: a dataset, a checkpoint folder, an answers file.
mpiexec -n 2 $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/keep/data" $small >"$tmp/keep.log" 2>&1 ||
  bad "setup: prepare: $(tail -3 "$tmp/keep.log")"
mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/keep/run" >>"$tmp/keep.log" 2>&1 ||
  bad "setup: train: $(tail -3 "$tmp/keep.log")"
echo '{"line": 1, "answer": "kept"}' >"$tmp/keep/answers.jsonl"
snapshot() { (cd "$tmp/keep" && find . -type f | sort | xargs sha256sum); }
snapshot >"$tmp/keep.sums"
# unchanged NAME: the kept files are as they were (after NAME's failed command).
unchanged() {
  if diff <(snapshot) "$tmp/keep.sums" >"$tmp/diff" 2>&1; then pass "$1-changes-nothing"
  else bad "$1-changes-nothing: $(cat "$tmp/diff")"; fi
}

# --- 1: a stopped rank ends the job -------------------------------------------------------------------------------
case_ 1

# children PID: the processes whose parent is PID, from /proc (procps may be missing).
children() {
  local f st ppid
  for f in /proc/[0-9]*/stat; do
    { read -r st <"$f"; } 2>/dev/null || continue  # gone since the glob
    read -r _ ppid _ <<<"${st##*) }"
    [[ $ppid == "$1" ]] && { f=${f#/proc/}; echo "${f%/stat}"; }
  done
}
# descendants PID: every process below PID.
descendants() {
  local c
  for c in $(children "$1"); do echo "$c"; descendants "$c"; done
}
# rank_pid PID RANK: the process of MPI rank RANK below PID (mpiexec's proxies set PMI_RANK).
rank_pid() {
  local p
  for p in $(descendants "$1"); do
    grep -qx "PMI_RANK=$2" <<<"$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)" && { echo "$p"; return; }
  done
}
now() { echo $(($(date +%s%N) / 1000000)); }  # ms
secs() { echo "$(($1 / 1000)).$(($1 % 1000 / 100))"; }
# bg_train NAME ARGS...: 4 ranks in the background (killed after 90 s: the old code hangs), log in $tmp/NAME.log.
bg_train() {
  local name=$1; shift
  timeout -k 3 90 mpiexec -n 4 $q train "${tiny[@]}" run.out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 &
  job=$!
}
# finish_stopped NAME T_STOP RANK STEP: the job ended non-zero within $limit s of T_STOP naming RANK and STEP, and
# the checkpoint of the step before verifies. Kills what the old code leaves behind.
finish_stopped() {
  local name=$1 t_stop=$2 rank=$3 step=$4 rc left p
  left=$(descendants "$job")
  wait "$job"; rc=$?
  local dt=$(($(now) - t_stop))
  for p in $left; do kill -KILL "$p" 2>/dev/null; done
  local log="$tmp/$name.log" ck="$tmp/$name/checkpoints/step_0000000$((step - 1)).h5"
  if [[ $rc -ne 0 ]] && ((dt < limit)) && grep -qE "watchdog: .*step $step" "$log" &&
     grep -qE "(did not arrive: $rank |no sign of life from rank $rank )" "$log"; then
    pass "$name (ended $(secs $dt) s after the stop, exit $rc)"
  else
    bad "$name: exit $rc $(secs $dt) s after the stop: $(grep -E 'error|watchdog' "$log" | head -5)"
  fi
  if tools/ckpt_info "$ck" --check >"$tmp/$name.check" 2>&1; then pass "$name-checkpoint-verifies"
  else bad "$name-checkpoint-verifies: $ck: $(tail -3 "$tmp/$name.check")"; fi
}
# With the test hook: rank 2 stops itself at step 2, after step 1's checkpoint.
for phase in forward backward checkpoint; do
  step=2
  bg_train "stop-$phase" checkpoint.every=1 runtime.debug_stop_rank=2 runtime.debug_stop_step=$step \
    runtime.debug_stop_phase=$phase
  t=""
  for _ in $(seq 600); do
    grep -q "stopping myself" "$tmp/stop-$phase.log" 2>/dev/null && { t=$(now); break; }
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  finish_stopped "stop-$phase" "${t:-$(now)}" 2 $step
done
# As in the issue: kill -STOP from outside after a step, and SIGTERM to mpiexec with the default long timeout.
for how in timeout sigterm; do
  args=(train.steps=40)
  [[ $how == sigterm ]] && args+=(runtime.timeout=600)
  bg_train "kill-$how" "${args[@]}"
  t="" victim=""
  for _ in $(seq 600); do
    if grep -q "^step 3/" "$tmp/kill-$how.log" 2>/dev/null; then
      victim=$(rank_pid "$job" 1)
      [[ -n $victim ]] && kill -STOP "$victim" && t=$(now)
      break
    fi
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  if [[ $how == sigterm ]]; then
    sleep 1
    kill -TERM $(children "$job") 2>/dev/null  # mpiexec, below timeout
    left=$(descendants "$job"); wait "$job"; rc=$?
    dt=$(($(now) - ${t:-0}))
    for p in $left; do kill -KILL "$p" 2>/dev/null; done
    # A pending SIGTERM bounds a collective wait to 10 s (Comm::kTermGrace), whatever runtime.timeout says.
    if [[ -n $t && $rc -ne 0 ]] && ((dt < 20000)); then pass "sigterm-ends-stopped-job ($(secs $dt) s)"
    else bad "sigterm-ends-stopped-job: exit $rc $(secs $dt) s after the stop: $(tail -4 "$tmp/kill-$how.log")"; fi
  else
    left=$(descendants "$job"); wait "$job"; rc=$?
    dt=$(($(now) - ${t:-0}))
    for p in $left; do kill -KILL "$p" 2>/dev/null; done
    if [[ -n $t && $rc -ne 0 ]] && ((dt < limit)) && grep -q "watchdog: " "$tmp/kill-$how.log" &&
       grep -qE "(did not arrive: 1 |no sign of life from rank 1 )" "$tmp/kill-$how.log"; then
      pass "kill-stop-named ($(secs $dt) s)"
    else
      bad "kill-stop-named: exit $rc $(secs $dt) s after the stop: $(grep -E 'error|watchdog' "$tmp/kill-$how.log" | head -3)"
    fi
  fi
done

# --- 2: a failed prepare keeps the dataset; replacing one needs prepare.overwrite ---------------------------------
case_ 2
awk 'NR == 5 { print "{\"messages\": [broken"; next } { print }' $d/train.jsonl >"$tmp/broken.jsonl"
cp -r "$tmp/keep/data" "$tmp/ds"
ds_sums() { (cd "$tmp/ds" && find . -type f | sort | xargs sha256sum); }
ds_sums >"$tmp/ds.sums"
# As in the issue (refused now: a dataset is there), then allowed to replace it (fails at line 5).
mpiexec -n 2 $q prepare prepare.input="$tmp/broken.jsonl" prepare.image_root=$d prepare.output="$tmp/ds" $small \
  >"$tmp/broken.log" 2>&1
expect broken-prepare-fails 1 "broken.jsonl:5: " mpiexec -n 2 $q prepare prepare.input="$tmp/broken.jsonl" \
  prepare.image_root=$d prepare.output="$tmp/ds" prepare.overwrite=true $small
diff -q <(ds_sums) "$tmp/ds.sums" >/dev/null && [[ ! -e $tmp/ds.partial ]] && pass "broken-prepare-keeps-dataset" ||
  bad "broken-prepare-keeps-dataset: $(ls "$tmp/ds" "$tmp"/ds.partial 2>&1)"
expect prepare-refuses-existing 1 "prepare.output '$tmp/ds' already holds a dataset .*prepare.overwrite = true" \
  mpiexec -n 2 $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/ds" $small
diff -q <(ds_sums) "$tmp/ds.sums" >/dev/null && pass "refused-prepare-keeps-dataset" || bad "refused-prepare-keeps-dataset"
expect prepare-overwrite 0 "11 record\(s\) -> 11 sample\(s\)" \
  mpiexec -n 2 $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/ds" prepare.shard_size=3 \
  prepare.min_pixels=1024 prepare.max_pixels=16384 prepare.min_side=3 prepare.overwrite=true
n=$(ls "$tmp/ds"/shard-*.h5 | wc -l)  # 11 samples on 2 ranks, 3 a shard: 4 shards, none of the old run's 4
[[ $n -eq 4 && ! -e $tmp/ds.partial ]] && grep -q '"checksum"' "$tmp/ds/index.json" && pass "overwrite-replaces-whole" ||
  bad "overwrite-replaces-whole: $(ls "$tmp/ds")"
mkdir -p "$tmp/notds" && echo hi >"$tmp/notds/notes.txt"
expect prepare-refuses-foreign-folder 1 "holds files that are not part of a dataset \(such as 'notes.txt'\)" \
  $q prepare prepare.input=$d/train.jsonl prepare.output="$tmp/notds" prepare.overwrite=true $small
unchanged prepare

# --- 3: a folder where a file is expected ------------------------------------------------------------------------
case_ 3
expect input-folder 1 "prepare.input '$d' is a folder; it must be a file" \
  $q prepare prepare.input=$d prepare.output="$tmp/keep/data" $small
expect prompts-folder 1 "generate.prompts '$d' is a folder; it must be a file" \
  $q generate model.preset=tiny generate.prompts=$d generate.output="$tmp/keep/answers.jsonl"
expect deck-folder 1 "deck 'input' is a folder; it must be a TOML file" $q check input
expect output-folder 1 "generate.output '$tmp/keep' is a folder" \
  $q generate model.preset=tiny generate.prompts=$d/train.jsonl generate.output="$tmp/keep"
unchanged folder-as-file

# --- 4: unwritable outputs are found at start-up -------------------------------------------------------------------
case_ 4
echo x >"$tmp/afile"
expect ckpt-dir-unwritable 1 "rank [0-9] \(.*\): checkpoint.dir '$tmp/afile/ck': cannot create the folder" \
  mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/unw" checkpoint.dir="$tmp/afile/ck"
[[ ! -e $tmp/unw/metrics.jsonl ]] && pass "ckpt-dir-unwritable-before-any-step" ||
  bad "ckpt-dir-unwritable-before-any-step: $(wc -l <"$tmp/unw/metrics.jsonl") steps ran"
expect out-dir-is-file 1 "run.out_dir '$tmp/afile' is a file; it must be a folder" \
  mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/afile"

# --- 5: STOP -> checkpoint, exit 3 --------------------------------------------------------------------------------
case_ 5
mkdir -p "$tmp/stopfile" && touch "$tmp/stopfile/STOP"
expect stop-file-exit-3 3 "stopping early: .*STOP found" \
  mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/stopfile" train.steps=10
[[ -f $tmp/stopfile/checkpoints/step_00000001.h5 && -e $tmp/stopfile/STOP.done ]] && pass "stop-file-checkpoint" ||
  bad "stop-file-checkpoint: $(ls "$tmp/stopfile" "$tmp/stopfile/checkpoints" 2>&1)"

# --- 6: a shard damaged after prepare -----------------------------------------------------------------------------
case_ 6
damage() {  # FILE: 64 random bytes in the middle of a shard's pixels (the file's size unchanged)
  $py - "$1" <<'PY'
import h5py, os, sys
with h5py.File(sys.argv[1]) as f:
    off, n = f["image_pixels"].id.get_offset(), f["image_pixels"].size
with open(sys.argv[1], "r+b") as f:
    f.seek(off + n // 2)
    f.write(os.urandom(64))
PY
}
cp -r "$tmp/keep/data" "$tmp/damaged"
shard=$(ls "$tmp/damaged" | grep -m1 '^shard-')
damage "$tmp/damaged/$shard"
expect damaged-shard 1 "shard $shard does not match its checksum in index.json" \
  mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/dmg" train.dataset="$tmp/damaged" train.steps=2
unchanged damaged-shard
# Each shard damaged in turn, 4 steps (16 samples of 12: every shard is read by step 3). A shard first read in step 2
# or later is read on the prefetch thread (data.prefetch, on by default), during the step before: its error still
# ends the run in the step that reads it, naming the shard, with exit 1, as without prefetch.
later=0 same=1
for s in $(ls "$tmp/keep/data" | grep '^shard-'); do
  rm -rf "$tmp/dmg_each" && cp -r "$tmp/keep/data" "$tmp/dmg_each" && damage "$tmp/dmg_each/$s"
  for on in true false; do
    mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/dmg_${s%.h5}_$on" train.dataset="$tmp/dmg_each" \
      data.prefetch=$on >"$tmp/dmg_$on.log" 2>&1
    # exit status, steps done, whether the shard is named (by one rank or more: the first error aborts the others)
    echo "$? $(grep -c 'step [0-9]*/4  loss' "$tmp/dmg_$on.log") $(grep -q "shard $s does not match its checksum" \
      "$tmp/dmg_$on.log" && echo named)" >"$tmp/dmg_$on.sum"
  done
  read -r rc steps named <"$tmp/dmg_true.sum"
  [[ $rc -eq 1 && $named == named && $(cat "$tmp/dmg_true.sum") == $(cat "$tmp/dmg_false.sum") ]] ||
    { same=0; echo "damaged $s: prefetch (exit, steps done, named) $(cat "$tmp/dmg_true.sum"), without $(cat "$tmp/dmg_false.sum")"; }
  ((steps > 0)) && later=$((later + 1))
done
((same && later > 0)) && pass "damaged-shard-on-prefetch-thread" ||
  bad "damaged-shard-on-prefetch-thread: same $same, $later shard(s) first read after step 1"

# --- 7: samples that teach nothing --------------------------------------------------------------------------------
case_ 7
# Two records without their assistant turn (images resolved against the test data's folder).
$py - $d/train.jsonl >"$tmp/nosup.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]).readlines()[:2]:
    r = json.loads(line)
    if "messages" in r: r["messages"] = [m for m in r["messages"] if m["role"] != "assistant"]
    else: r["conversations"] = [m for m in r["conversations"] if m["from"] != "gpt"]
    print(json.dumps(r))
PY
cat "$tmp/nosup.jsonl" $d/train.jsonl >"$tmp/mixed.jsonl"
expect unsupervised-counted 0 "13 sample\(s\) .*; 2 sample\(s\) without supervised tokens" \
  $q prepare prepare.input="$tmp/mixed.jsonl" prepare.image_root=$d prepare.output="$tmp/mixed" $small
expect unsupervised-all 1 "none of the 2 sample\(s\) has a supervised token" \
  $q prepare prepare.input="$tmp/nosup.jsonl" prepare.image_root=$d prepare.output="$tmp/nosup" $small
: >"$tmp/empty.jsonl"
expect empty-input 1 "prepare.input '$tmp/empty.jsonl' holds no records" \
  mpiexec -n 2 $q prepare prepare.input="$tmp/empty.jsonl" prepare.output="$tmp/empty" $small
[[ ! -e $tmp/empty && ! -e $tmp/nosup && ! -e $tmp/empty.partial ]] && pass "failed-prepare-leaves-no-dataset" ||
  bad "failed-prepare-leaves-no-dataset: $(ls -d "$tmp"/empty* "$tmp"/nosup* 2>&1)"

# --- 8: messages ---------------------------------------------------------------------------------------------------
case_ 8
cp -r "$tmp/keep/run" "$tmp/resume"
truncate -s $(($(stat -c %s "$tmp/resume/checkpoints/step_00000004.h5") / 2)) "$tmp/resume/checkpoints/step_00000004.h5"
out=$(mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/resume" train.steps=3 train.resume=auto 2>&1)
if grep -q "'latest' names step_00000004.h5, which is damaged or missing; step_00000002.h5 is the newest" <<<"$out" &&
   ! grep -q "but step_00000002.h5 is newer" <<<"$out"; then pass "resume-note-says-older"
else bad "resume-note-says-older: $(grep -E 'resume|latest' <<<"$out")"; fi
out=$($q check =3 2>&1); rc=$?
if [[ $rc -eq 1 ]] && grep -q "command line: '=3': the override lacks a key" <<<"$out" && ! grep -q run.name <<<"$out"
then pass "override-without-key"; else bad "override-without-key: exit $rc: $out"; fi
printf '{"messages": [broken\n' >"$tmp/bad_prompts.jsonl"
for n in 1 2; do
  out=$(mpiexec -n $n $q generate model.preset=tiny generate.prompts="$tmp/bad_prompts.jsonl" \
        generate.output="$tmp/keep/answers.jsonl" 2>&1); rc=$?
  if [[ $rc -ne 0 ]] && grep -q "q3vl: error on rank 0 .*bad_prompts.jsonl:1" <<<"$out" &&
     ! grep -qE "Abort\(|MPI_Abort" <<<"$out"; then pass "no-abort-noise-np$n"
  else bad "no-abort-noise-np$n: exit $rc: $out"; fi
done
unchanged messages

# --- 9: runs that lose nothing ------------------------------------------------------------------------------------
case_ 9
# keep/run holds step 2 and 4 of one run. A fresh run (resume = never) into it would rotate them with its own and
# leave `latest` to whichever step is higher: refused, nothing changed.
cp -r "$tmp/keep/run" "$tmp/used"
expect fresh-run-refused 1 "checkpoint.dir '$tmp/used/checkpoints' holds 2 checkpoint\(s\) of another run \(step_00000004.h5, \.\.\.\), and this run starts afresh \(train.resume = never\).*checkpoint.overwrite = true" \
  mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/used" train.steps=3 train.resume=never
diff -r "$tmp/keep/run/checkpoints" "$tmp/used/checkpoints" >/dev/null && pass "fresh-run-refused-changes-nothing" ||
  bad "fresh-run-refused-changes-nothing: $(ls -R "$tmp/used/checkpoints")"
# With checkpoint.overwrite the old ones go to replaced.1 (bitwise as they were); the new run's steps 2 and 3 are
# kept, `latest` names step 3, and resume = auto continues the new run.
out=$(mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/used" train.steps=3 train.resume=never checkpoint.overwrite=true 2>&1)
ls1=$(cd "$tmp/used/checkpoints" && ls | tr '\n' ' ')
grep -q "checkpoint.overwrite: 2 checkpoint(s) of another run (step_00000004.h5, ...) moved to $tmp/used/checkpoints/replaced.1" <<<"$out" &&
  [[ $ls1 == "latest replaced.1 step_00000002.h5 step_00000003.h5 tokenizer.json " ]] && [[ $(cat "$tmp/used/checkpoints/latest") == step_00000003.h5 ]] &&
  cmp -s "$tmp/keep/run/checkpoints/step_00000004.h5" "$tmp/used/checkpoints/replaced.1/step_00000004.h5" &&
  pass "overwrite-moves-aside" || bad "overwrite-moves-aside: $ls1 $(grep -E 'overwrite|error' <<<"$out")"
out=$(mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/used" train.steps=4 2>&1)
grep -q "resumed from $tmp/used/checkpoints/step_00000003.h5" <<<"$out" && pass "overwrite-then-resume-own-run" ||
  bad "overwrite-then-resume-own-run: $(grep -E 'resum|error' <<<"$out")"
# A newest checkpoint whose file is sound and whose numbers are not (one weight changed in place, same size):
# skipped with a warning naming it and the tensor, and the run resumes from step 2 (was: exit 1).
cp -r "$tmp/keep/run" "$tmp/corrupt"
$py - "$tmp/corrupt/checkpoints/step_00000004.h5" <<'PY'
import h5py, sys
with h5py.File(sys.argv[1], "r+") as f:
    d = f["model/model.language_model.norm.weight"]
    d[0] = d[0] + 1.0
PY
out=$(mpiexec -n 2 $q train "${tiny[@]}" run.out_dir="$tmp/corrupt" train.steps=4 2>&1); rc=$?
[[ $rc -eq 0 ]] && grep -q "resume: skipping checkpoint '$tmp/corrupt/checkpoints/step_00000004.h5' is corrupt: tensor model/model.language_model.norm.weight does not match its checksum; falling back to $tmp/corrupt/checkpoints/step_00000002.h5" <<<"$out" &&
  grep -q "resumed from $tmp/corrupt/checkpoints/step_00000002.h5" <<<"$out" && pass "checksum-corrupt-newest-skipped" ||
  bad "checksum-corrupt-newest-skipped: exit $rc: $(grep -E 'resum|error|skipping' <<<"$out")"

echo "test_faults: $((SECONDS - t_suite)) s"
finish
