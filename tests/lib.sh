# The preamble and helpers of the shell test suites (tests/cli, tests/tools, tests/slurm). A suite starts with
#   source "$(dirname "$0")/../lib.sh"
# and ends with `finish`. Sourcing it: strict mode, the repository root as the working directory, one BLAS
# thread, $q (the q3vl binary), $py (the system Python with h5py and numpy), $tmp (a fresh directory removed
# on exit) and the counters behind pass, bad, skip and finish.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
q=bin/q3vl
py=/usr/bin/python3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=0 passes=0 skips=0

# pass NAME: one check passed. bad MESSAGE: one check failed (MESSAGE starts with the check's name).
# skip NAME REASON: a check that did not run; tests/run_all.sh lists every "skip: " line with its reason.
pass() { echo "ok: $1"; passes=$((passes + 1)); }
bad() { echo "FAIL: $1"; fails=$((fails + 1)); }
skip() { echo "skip: $1 — $2"; skips=$((skips + 1)); }

# needs NAME WHAT...: true when every WHAT (a path such as bin/q3vl, or a command) is there; otherwise skips
# the check (or section) NAME, naming what is missing. Guard sections on this, never on --help text.
needs() {
  local name=$1 w; shift
  for w in "$@"; do
    command -v "$w" >/dev/null || { skip "$name" "$w not found"; return 1; }
  done
}

# expect NAME RC PATTERN CMD...: the command (a program or a shell function) exits with RC and its output,
# stdout and stderr together, matches the extended regular expression PATTERN.
expect() {
  local name=$1 want_rc=$2 pat=$3; shift 3
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [[ $rc -ne $want_rc ]]; then bad "$name: exit $rc, wanted $want_rc; output: $out"; return; fi
  if ! grep -qE -- "$pat" <<<"$out"; then bad "$name: output does not match /$pat/: $out"; return; fi
  pass "$name"
}

# finish: the summary line that tests/run_all.sh reads ("N passed, N failed, N skipped"); exits 1 if any check
# failed.
finish() {
  echo "$passes passed, $fails failed, $skips skipped"
  exit $((fails > 0))
}
