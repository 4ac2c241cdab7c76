#!/usr/bin/env bash
# Issue 32's checks in one GPU call (from the repo root, the packed runtime sourced):
#   tools/gpu/serve7_check.sh Q3VL UNIT_TESTS OUTDIR
# 1. the device suites the change touches: batched vision passes against a pass each (fp32, bf16), serving steps
#    against the host model (the features now uploaded from the segments), decode graphs, the profiler;
# 2. the 8B shape at 64 streams (serve_checks.sh's 8b part, PROFILE=2: two decode-only and two mixed steps of 56+ rows
#    profiled op by op), the new vision batching against serve.vision_batch = false (part 8bnovb) in the same call.
# Prints a short table last; exits 1 when a unit test fails, a request fails or no profile was logged.
set -u
q=$1 ut=$2 final=$3
mkdir -p "$final"
rc=0
Q3VL_REQUIRE_GPU=1 timeout 150 "$ut" \
  --gtest_filter='DevInfer.BatchedVision*:DevInfer.StepMatchesHostOnCudaBf16:DevInfer.DecodeGraphsMatchHostOnCuda:DevInfer.StepMatchesHostOnCpu:Profile.*' \
  >"$final/unit.log" 2>&1 || rc=1
unit=$(grep -E '^\[  (PASSED|FAILED) *\]' "$final/unit.log" | tr '\n' ' ')
CONC=64 PROFILE=${PROFILE:-2} timeout 420 bash tools/gpu/serve_checks.sh "$q" "$ut" "$final" "8b 8bnovb"
res=/tmp/results  # serve_checks.sh's own folder
echo
echo "unit: $unit"
grep -h "batched vision on" "$final/unit.log"
printf '| %-18s | %6s | %10s | %9s | %s\n' run errors "out tok/s" "TPOT p50" "engine"
for n in 8b 8b-novisionbatch; do
  row=$(grep -h "c=64" "$res/bench_$n.txt" 2>/dev/null | tail -1)
  eng=$(grep -h "^engine over" "$res/bench_$n.txt" 2>/dev/null | tail -1)
  IFS='|' read -r _ _ _ _ err _ tps _ _ _ _ _ _ tpot _ <<<"$row"
  printf '| %-18s | %6s | %10s | %9s | %s\n' "$n" "${err// /}" "${tps// /}" "${tpot// /}" "$eng"
  [[ -n $row && ${err// /} == 0 ]] || rc=1
done
# The profiled steps: rows, time, the phases and the five costliest ops of each.
python3 - "$res/profile_8b.jsonl" <<'EOF' || rc=1
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert rs, "no profiled step"
for r in rs:
    ph = ", ".join(f"{p['name'].split(' (')[0]} {p['ms']:.2f}" for p in r["phases"] if p["ms"] >= 0.01)
    ops = ", ".join(f"{o['name']} {o['calls']}x {o['ms']:.2f}" for o in r["ops"][:5])
    print(f"{r['kind']} step, {r['rows']} rows ({r['prompt_tokens']} prompt tokens): {r['step_ms']:.2f} ms op by op, "
          f"busy {r['busy_ms']:.2f} ms | {ph} | top: {ops}")
EOF
exit $rc
