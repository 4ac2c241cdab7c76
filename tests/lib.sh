# The preamble and helpers of the shell test suites (tests/cli, tests/tools, tests/slurm). A suite starts with
#   source "$(dirname "$0")/../lib.sh"
# and ends with `finish`. Sourcing it: strict mode, the repository root as the working directory, one BLAS
# thread, $q (the q3vl binary), $py (the system Python with h5py and numpy), $tmp (a fresh directory removed
# on exit) and the counters behind pass, bad, skip and finish.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
q=${Q3VL_BIN:-bin/q3vl}
py=/usr/bin/python3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=0 passes=0 skips=0

# Never `cmd | grep -q PAT` here: grep leaves at the first match, cmd's next write dies of SIGPIPE and pipefail
# fails the check at random (a sub-make's "Leaving directory" line did, in CI). Use grep -q PAT <<<"$(cmd)".
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

# node_client_missing: why the OpenAI Node client (tests/cli/serve_client.mjs) cannot run here, or nothing.
node_client_missing() {
  if ! command -v node >/dev/null; then echo "node not found (make deps installs nodejs)"
  elif [[ ! -f third_party/npm/node_modules/openai/package.json ]]; then
    echo "the OpenAI client is not in third_party/npm (bash tools/fetch_tokenizer.sh installs it)"
  fi
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

# holds EXPR X...: the Python expression EXPR over x[0], x[1], ... (the numbers X) is true, and every X is a finite
# number. Never awk's or Python's bare `a < b`: false for NaN, so `exit(a > tol)` passes a NaN and awk reads "nan"
# or an empty string as 0; here a missing value, NaN or Inf fails.
holds() {
  $py -c 'import math, sys
try: x = [float(v) for v in sys.argv[2:]]
except ValueError: sys.exit(1)
sys.exit(not (all(map(math.isfinite, x)) and eval(sys.argv[1], {"abs": abs}, {"x": x})))' "$@"
}

# Training runs' comparisons (run NAMEs are folders under $tmp; FILEs are checkpoints):
# cmp_losses A B TOL [STEPS]: per-step losses of two runs agree to TOL relative (and each logged STEPS steps).
cmp_losses() {
  $py - "$tmp/$1/metrics.jsonl" "$tmp/$2/metrics.jsonl" "$3" "${4:-0}" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
tol, steps = float(sys.argv[3]), int(sys.argv[4])
assert len(a) == len(b) and len(a) > 0, f"{len(a)} vs {len(b)} steps"
assert steps == 0 or len(a) == steps, f"{len(a)} steps, wanted {steps}"
for x, y in zip(a, b):
    assert x["step"] == y["step"], (x["step"], y["step"])
    d = abs(x["loss"] - y["loss"]) / abs(y["loss"])
    assert d <= tol, f"step {x['step']}: loss {x['loss']} vs {y['loss']} (rel {d:.2e})"
PY
}
# cmp_ckpt FILE_A FILE_B TOL: every dataset present in both with the same shape, every value finite (two runs that
# diverge to the same NaN are bitwise equal); weights agree to TOL and AdamW moments to 10 TOL in norm,
# ||a-b|| / ||b|| (TOL 0: bitwise). Norms, not elements: Adam's first steps move an element whose gradient is at
# rounding level by +-lr whatever its size, so a few such elements differ more.
cmp_ckpt() {
  $py - "$1" "$2" "$3" <<'PY'
import h5py, numpy as np, sys
tol = float(sys.argv[3])
with h5py.File(sys.argv[1]) as fa, h5py.File(sys.argv[2]) as fb:
    na, nb = [], []
    fa.visititems(lambda n, o: na.append(n) if isinstance(o, h5py.Dataset) else None)
    fb.visititems(lambda n, o: nb.append(n) if isinstance(o, h5py.Dataset) else None)
    assert sorted(na) == sorted(nb), f"dataset lists differ: {set(na) ^ set(nb)}"
    assert any(n.startswith("optim/exp_avg_sq/") for n in na)
    for n in na:
        a, b = fa[n][()], fb[n][()]
        assert a.shape == b.shape, n
        assert np.isfinite(a).all() and np.isfinite(b).all(), f"{n}: NaN or Inf"
        if tol == 0:
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{n} differs"
        else:
            d = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
            assert d <= (tol if n.startswith("model/") else 10 * tol), f"{n}: relative difference {d:.2e}"
PY
}
ckpt() { ls "$tmp/$1/checkpoints"/step_*.h5 | tail -1; }
ok_run() { if [[ $1 -ne 0 ]]; then bad "$2: exit $1: $(tail -5 "$tmp/$2.log")"; return 1; fi; }
# server_port LOG PID: the port of a `q3vl serve` started with serve.port=0, once LOG names it (printed); fails when
# PID exits first or after 60 s.
server_port() {
  local p
  for _ in $(seq 300); do
    p=$(grep -oP 'serve: model .* on http://[0-9.]+:\K[0-9]+' "$1") && { echo "$p"; return 0; }
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

# same_answers NAME FILE: FILE's answers (serve_client.mjs's JSON lines) equal generate's in $ref (default
# $tmp/gen.jsonl), line by line, and are complete: text, finish reason, prompt and completion tokens.
same_answers() {
  $py - "${ref:-$tmp/gen.jsonl}" "$2" <<'EOF' && pass "$1" || bad "$1: $(head -c 600 $2)"
import json, sys
gen = {r["line"]: r for r in map(json.loads, open(sys.argv[1]))}
got = [json.loads(l) for l in open(sys.argv[2]) if '"line"' in l]
assert got, "no answers"
for r in got:
    g = gen[r["line"]]
    assert "error" not in r, r
    assert r["answer"] == g["answer"], (r, g)
    assert r["finish"] == ("stop" if g["stop"] == "eos" else "length"), (r, g)
    if r.get("usage"):
        assert r["usage"]["prompt_tokens"] == g["prompt_tokens"] and r["usage"]["completion_tokens"] == g["new_tokens"], (r, g)
EOF
}

# finish: the summary line that tests/run_all.sh reads ("N passed, N failed, N skipped"); exits 1 if any check
# failed.
finish() {
  echo "$passes passed, $fails failed, $skips skipped"
  exit $((fails > 0))
}
