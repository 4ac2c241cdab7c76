#!/usr/bin/env bash
# Runs every test suite and ends with one summary line "N passed, N failed".
# The MPI suite runs at 1, 2 and 4 ranks; a failure on any rank fails the suite.
set -uo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
MPIEXEC=${MPIEXEC:-mpiexec}
log_dir=build/test-logs
mkdir -p "$log_dir"
passed=0 failed=0 failed_suites=()

# run NAME CMD...: one suite; counts GoogleTest's pass/fail lines (or the exit code for plain scripts).
run() {
  local name=$1; shift
  local log="$log_dir/$name.log" t0=$SECONDS
  printf '%-28s ' "$name"
  "$@" >"$log" 2>&1
  local rc=$?
  local p f
  p=$(grep -oP '^\[  PASSED  \] \K[0-9]+' "$log" | tail -1)
  f=$(grep -oP '^\[  FAILED  \] \K[0-9]+(?= tests?, listed below)' "$log" | tail -1)
  if [[ -z $p && -z $f ]]; then  # a script: its own "N passed, N failed" line
    p=$(grep -oP '^\K[0-9]+(?= passed, [0-9]+ failed$)' "$log" | tail -1)
    f=$(grep -oP '^[0-9]+ passed, \K[0-9]+(?= failed$)' "$log" | tail -1)
  fi
  if [[ -z $p && -z $f ]]; then  # neither: one test, judged by its exit code
    if ((rc == 0)); then p=1 f=0; else p=0 f=1; fi
  fi
  p=${p:-0} f=${f:-0}
  if ((rc != 0 && f == 0)); then f=1; fi  # crashed or a rank failed outside a test
  passed=$((passed + p)) failed=$((failed + f))
  if ((f > 0)); then
    failed_suites+=("$name")
    echo "FAILED ($p passed, $f failed, $((SECONDS - t0)) s) — log: $log"
    grep -E '^\[  FAILED  \]|Failure|error' "$log" | head -20 | sed 's/^/    /'
  else
    echo "ok ($p passed, $((SECONDS - t0)) s)"
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
  run slurm-start bash tests/slurm/start.sh
  run slurm bash tests/slurm/test_slurm.sh
  bash tests/slurm/stop.sh >/dev/null 2>&1
fi

echo
((${#failed_suites[@]})) && echo "failed suites: ${failed_suites[*]}"
echo "$passed passed, $failed failed"
((failed == 0))
