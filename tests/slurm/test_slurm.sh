#!/usr/bin/env bash
# The Slurm suite, against the one-node cluster of tests/slurm/start.sh (4 CPUs; run_all.sh starts it):
# the smoke job script, q3vl check under srun (pass, and failures naming rank and host), the watchdog
# naming the rank that did not arrive, and preemption: SIGUSR1 mid-run -> checkpoint -> requeue ->
# resume -> a final checkpoint bitwise equal to an uninterrupted run's, and a job that ends COMPLETED.
# Ends with "N passed, N failed, N skipped"; exits non-zero on any failure.
source "$(dirname "$0")/../lib.sh"
dir=${Q3VL_SLURM_DIR:-/tmp/q3vl-slurm}
[[ -f $dir/env ]] || { echo "no test Slurm: run tests/slurm/start.sh first"; echo "0 passed, 1 failed, 0 skipped"
                       exit 1; }
source "$dir/env"
work=$(mktemp -d /tmp/q3vl-slurm-test.XXXXXX)
trap 'rm -rf "$tmp" "$work"' EXIT  # replaces lib.sh's trap, so removes its $tmp as well
host=$(hostname)

# This suite's own report lines, in columns; a failure shows the tail of each LOG named after its message.
# They count in lib.sh's counters, so finish reports them (and run_all.sh lists the "skip  " lines).
pass() { echo "ok    $1"; passes=$((passes + 1)); }
skip() { echo "skip  $1 — $2"; skips=$((skips + 1)); }
# The FAIL line itself carries the first log's last line: run_all.sh repeats FAIL lines at the end, where CI shows them.
bad() {
  local msg=$1 last=""; shift
  [[ -f ${1:-} ]] && last=$(grep -v '^[[:space:]]*$' "$1" | tail -n 1)
  echo "FAIL  $msg${last:+ — last line of ${1##*/}: ${last:0:200}}"
  for f in "$@"; do [[ -f $f ]] && tail -n 25 "$f" | sed 's/^/      /'; done
  fails=$((fails + 1))
}
# expect_log NAME LOG PATTERN...: every extended regex is in LOG.
expect_log() {
  local name=$1 log=$2; shift 2
  for p in "$@"; do grep -Eq -- "$p" "$log" || { bad "$name (no /$p/ in $log)" "$log"; return 1; }; done
  pass "$name"
}
job_field() { scontrol show job "$1" 2>/dev/null | grep -oP "\b$2=\K\S+" | head -1; }
# wait_job ID SECONDS: until the job has left the queue. A requeued job waits out Slurm's hold (start.sh
# shortens it to 21 s); starting it early races the old run's step daemons (see jobs/common.sh).
wait_job() {
  local id=$1 t=$((SECONDS + $2))
  while ((SECONDS < t)); do
    [[ -z $(squeue -h -j "$id" -o %T 2>/dev/null) ]] && return 0
    sleep 1
  done
  scancel "$id"
  return 1
}

# --- q3vl check under srun -------------------------------------------------------------------
srun --mpi=pmi2 -n 4 bin/q3vl check run.out_dir="$work/chk" >"$work/chk.log" 2>&1
rc=$?
if ((rc == 0)); then expect_log "check passes on 4 tasks" "$work/chk.log" "check passed: 4 rank\(s\) on 1 node"
else bad "check passes on 4 tasks (exit $rc)" "$work/chk.log"; fi

srun --mpi=pmi2 -n 4 bin/q3vl check run.out_dir="$work/chk" model.backend=cuda >"$work/cuda.log" 2>&1
if (($? != 0)); then expect_log "check fails without GPUs for model.backend=cuda" "$work/cuda.log" \
  "check failed" "rank 3 on $host: no GPU visible"
else bad "check fails without GPUs for model.backend=cuda (exit 0)" "$work/cuda.log"; fi

touch "$work/file"
srun --mpi=pmi2 -n 4 bin/q3vl check run.out_dir="$work/file/out" >"$work/nodir.log" 2>&1
if (($? != 0)); then expect_log "check fails when out_dir cannot be made" "$work/nodir.log" \
  "rank 0 on $host: cannot stat output directory $work/file/out" "rank 3 on $host"
else bad "check fails when out_dir cannot be made (exit 0)" "$work/nodir.log"; fi

# A read-only, nearly full file system, where this machine lets root mount one.
mkdir -p "$work/ro"
if mount -t tmpfs -o ro,size=1m tmpfs "$work/ro" 2>/dev/null; then
  srun --mpi=pmi2 -n 4 bin/q3vl check run.out_dir="$work/ro" >"$work/ro.log" 2>&1
  rc=$?
  umount "$work/ro"
  if ((rc != 0)); then expect_log "check fails on a read-only, full out_dir" "$work/ro.log" \
    "rank 2 on $host: less than 1 GB free in $work/ro" "rank 2 on $host: cannot write to output directory $work/ro: Read-only"
  else bad "check fails on a read-only, full out_dir (exit 0)" "$work/ro.log"; fi
else
  skip "check on a read-only out_dir" "cannot mount a tmpfs here"
fi

# --- watchdog: rank 2 arrives 60 s late; the others must name it and end the job within the timeout --
# (5 s, not less: on a loaded 2-core machine the start-up collectives alone can take a couple of seconds)
for launcher in "mpiexec -n 4" "srun --mpi=pmi2 -n 4"; do
  t0=$SECONDS
  timeout 60 $launcher bin/q3vl check run.out_dir="$work/chk" runtime.timeout=5 runtime.debug_sleep_rank=2 \
    runtime.debug_sleep_seconds=60 >"$work/wd.log" 2>&1
  rc=$? dt=$((SECONDS - t0))
  if ((rc == 0 || rc == 124 || dt > 20)); then bad "watchdog under ${launcher%% *} (exit $rc after $dt s)" "$work/wd.log"
  else expect_log "watchdog under ${launcher%% *} names rank 2 and aborts ($dt s)" "$work/wd.log" \
    "watchdog: collective all_gather #[0-9]+ on a 4-rank mpi communicator did not complete within runtime.timeout = 5" \
    "ranks that did not arrive: 2 \(2 at #[0-9]+\)"; fi
done

# --- the smoke job script: check, then a short training run -----------------------------------
tiny=(model.preset=tiny data.seq_len=64 train.global_batch=4 run.timing=false)
if [[ -f input/demo.deck ]]; then
  smoke_deck=input/demo.deck smoke_args=(synth.train_samples=32 synth.eval_samples=4 data.seq_len=128
                                         train.global_batch=4 train.steps=2 checkpoint.every=0 run.timing=false)
else smoke_deck="" smoke_args=("${tiny[@]}" train.steps=2); fi
id=$(DECK=$smoke_deck OUT=$work/smoke sbatch --parsable --output="$work/smoke-%j.out" jobs/smoke.slurm \
  "${smoke_args[@]}")
if wait_job "$id" 600 && [[ $(job_field "$id" JobState) == COMPLETED ]]; then
  expect_log "smoke job (4 tasks): check and train complete" "$work/smoke-$id.out" \
    "check passed: 4 rank\(s\)" "training done: step 2"
else bad "smoke job $id: $(job_field "$id" JobState)" "$work/smoke-$id.out"; fi

# --- preemption: SIGUSR1 mid-run -> checkpoint, exit 3 -> requeue -> resume -> same final weights --
# 40 steps: the signal must land while the run is still training. With 5 (as before) a fast machine finished all
# of them between the first metrics line and the signal's arrival (poll interval plus Slurm's delivery), and the
# job completed unpreempted (Restarts=0): the suite's one flaky check in CI.
run=("${tiny[@]}" train.steps=40 checkpoint.every=0)
srun --mpi=pmi2 -n 4 bin/q3vl train "${run[@]}" run.out_dir="$work/ref" >"$work/ref.log" 2>&1 \
  || bad "uninterrupted reference run" "$work/ref.log"
t_pre=$SECONDS
id=$(DECK= OUT=$work/pre sbatch --parsable --output="$work/pre-%j.out" jobs/smoke.slurm "${run[@]}")
# Signal once the first step is logged, so the run is mid-way and its handlers are installed.
for _ in $(seq 2000); do [[ -s $work/pre/metrics.jsonl ]] && break; sleep 0.2; done
scancel --signal=USR1 "$id"
log=$work/pre-$id.out
ref=$work/ref/checkpoints/step_00000040.h5 got=$work/pre/checkpoints/step_00000040.h5
if ! wait_job "$id" 600 || [[ $(job_field "$id" JobState) != COMPLETED ]]; then
  bad "preempted job $id: $(job_field "$id" JobState) after $((SECONDS - t_pre)) s" "$log"
elif [[ $(job_field "$id" Restarts) != 1 ]]; then
  bad "preempted job was requeued once (Restarts=$(job_field "$id" Restarts))" "$log"
elif expect_log "SIGUSR1 -> checkpoint at step $(grep -oP 'checkpoint of step \K[0-9]+' "$log" | head -1) of 40, exit 3, \
requeue, resume, done" "$log" \
    "stopping early: SIGUSR1 received" "exit 3\): requeueing" "restart 1" "training done: step 40"; then
  if ! needs "resumed run's final checkpoint equals the uninterrupted run's" h5diff; then :
  elif h5diff -q "$ref" "$got" /model /model && h5diff -q "$ref" "$got" /optim /optim; then
    pass "resumed run's final checkpoint equals the uninterrupted run's"
  else bad "resumed run's final checkpoint differs from the uninterrupted run's" "$log"; fi
fi

finish
