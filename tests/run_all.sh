#!/usr/bin/env bash
# Runs every test suite and ends with one summary line "N passed, N failed, N skipped", after the list of
# every skipped check with its reason. The MPI suite runs at 1, 2 and 4 ranks; a failure on any rank fails
# the suite. Q3VL_REQUIRE_SLURM=1 makes a missing Slurm a failure (Q3VL_REQUIRE_GPU=1, read by the GPU
# tests themselves, does the same for a missing GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
MPIEXEC=${MPIEXEC:-mpiexec}
log_dir=build/test-logs
mkdir -p "$log_dir"
passed=0 failed=0 skipped=0 failed_suites=() skip_list=() fail_list=()

# The fewest checks each suite runs (passed + failed + skipped), a little under today's counts: fewer (a filter that
# selects nothing, a script that ends early) fail the suite, as does a suite without a summary line. A suite whose
# every check is skipped, each with its reason, is reported as skipped instead. Suites not listed: at least 1.
declare -A min_checks=(
  [unit]=184 [mpi-np1]=78 [mpi-np2]=78 [mpi-np4]=78
  [test_cli]=16 [test_demo]=8 [test_demo_lora]=9 [test_ep]=10 [test_eval]=8 [test_faults]=26 [test_generate]=18
  [test_int8]=15 [test_lora]=41 [test_plan]=18 [test_prepare]=9 [test_serve]=24 [test_train]=45 [test_video]=45
  [test_ckpt_info]=20 [test_export_hf]=40 [test_metrics_tools]=25 [slurm-start]=1 [slurm]=8
)

# skip_suite NAME REASON: a whole suite that cannot run here.
skip_suite() {
  printf '%-28s skipped: %s\n' "$1" "$2"
  skipped=$((skipped + 1)) skip_list+=("$1: whole suite — $2")
}

# one_check CMD...: a command that is one check, judged by its exit code, with the summary line run reads.
one_check() {
  if "$@"; then echo "1 passed, 0 failed, 0 skipped"
  else echo "FAIL: $* exited $?"; echo "0 passed, 1 failed, 0 skipped"; fi
}

# run NAME CMD...: one suite; counts GoogleTest's pass/fail/skip lines (or a script's own summary line), holds the
# suite to its minimum number of checks, and collects the reason of every skip.
run() {
  local name=$1; shift
  local log="$log_dir/$name.log" t0=$SECONDS
  printf '%-28s ' "$name"
  "$@" >"$log" 2>&1
  local rc=$?
  local p f s line why="" short="" min=${min_checks[$name]:-1}
  p=$(grep -oP '^\[  PASSED  \] \K[0-9]+' "$log" | tail -1)
  f=$(grep -oP '^\[  FAILED  \] \K[0-9]+(?= tests?, listed below)' "$log" | tail -1)
  s=$(grep -oP '^\[  SKIPPED \] \K[0-9]+(?= tests?, listed below)' "$log" | tail -1)
  if [[ -n $p || -n $f ]]; then
    # GoogleTest: "FILE:LINE: Skipped", the GTEST_SKIP message, then "[  SKIPPED ] Suite.Test (N ms)".
    why=$(awk '/ Skipped$/ { why = ""; getline why; next }
               /^\[  SKIPPED \] [^ ]+ \([0-9]+ ms\)$/ { print $4 " — " (why == "" ? "no reason given" : why) }' "$log")
  else  # a script: its own "N passed, N failed[, N skipped]" line and "skip: NAME — REASON" lines
    line=$(grep -P '^[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$log" | tail -1)
    if [[ -n $line ]]; then
      p=$(grep -oP '^[0-9]+' <<<"$line") f=$(grep -oP '[0-9]+(?= failed)' <<<"$line")
      s=$(grep -oP '[0-9]+(?= skipped)' <<<"$line")
      why=$(grep -oP '^skip:? +\K.*' "$log")
    else p=0 f=1 short="no summary line (N passed, N failed, N skipped), exit $rc"; fi
  fi
  [[ -n $why ]] && while IFS= read -r line; do skip_list+=("$name: $line"); done <<<"$why"
  p=${p:-0} f=${f:-0} s=${s:-0}
  if ((rc != 0 && f == 0)); then f=1; fi  # crashed or a rank failed outside a test
  if [[ -z $short ]] && ((p + f + s < min && (p + f > 0 || s == 0))); then
    short="$((p + f + s)) checks ran, fewer than the suite's minimum of $min (tests/run_all.sh)" f=$((f + 1))
  fi
  passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
  local skips=""
  ((s > 0)) && skips=", $s skipped"
  if ((f > 0)); then
    failed_suites+=("$name")
    echo "FAILED ($p passed, $f failed$skips, $((SECONDS - t0)) s) — log: $log"
    # What failed, also listed again at the end: CI shows only the tail of this output.
    line=$(grep -E '^FAIL[: ] |^\[  FAILED  \] [^ ]+ \(|: Failure$' "$log" | head -8)
    [[ -n $short ]] && line=$(printf '%s\n%s' "$short" "$line")
    [[ -z ${line//$'\n'/} ]] && line="exit $rc; last line: $(tail -1 "$log")"
    line=$(sed '/^$/d' <<<"$line")
    sed 's/^/    /' <<<"$line"
    while IFS= read -r line; do fail_list+=("$name: ${line:0:300}"); done <<<"$line"
  else
    echo "ok ($p passed$skips, $((SECONDS - t0)) s)"
  fi
}

run unit bin/unit_tests
for n in 1 2 4; do
  run "mpi-np$n" "$MPIEXEC" -n "$n" bin/mpi_tests
done
for t in tests/cli/*.sh tests/tools/*.sh; do
  [[ -f $t ]] && run "$(basename "${t%.sh}")" bash "$t"
done
# A real one-node Slurm (munge, slurmctld, slurmd from Debian's packages) for the job-script tests.
if command -v slurmctld >/dev/null; then
  run slurm-start one_check bash tests/slurm/start.sh
  run slurm bash tests/slurm/test_slurm.sh
  bash tests/slurm/stop.sh >/dev/null 2>&1
elif [[ ${Q3VL_REQUIRE_SLURM:-0} == 1 ]]; then
  run slurm bash -c 'echo "FAIL: slurmctld not found and Q3VL_REQUIRE_SLURM=1 (make deps installs slurm-wlm)"
                    echo "0 passed, 1 failed, 0 skipped"; exit 1'
else
  skip_suite slurm "slurmctld not found (make deps installs slurm-wlm; Q3VL_REQUIRE_SLURM=1 makes this a failure)"
fi

echo
if ((${#skip_list[@]})); then
  echo "skipped checks:"
  printf '  %s\n' "${skip_list[@]}"
fi
if ((${#failed_suites[@]})); then
  echo "failed checks (logs in $log_dir):"
  printf '  %s\n' "${fail_list[@]}"
  echo "failed suites: ${failed_suites[*]}"
fi
echo "$passed passed, $failed failed, $skipped skipped"
((failed == 0))
