#!/usr/bin/env bash
# call 7h (thirty-first session; ran on an H100 at 17:17 UTC when the H200 was refused): binaries of 4a566c7, as call 6. (1) serving on
# the GPU against generate on the CPU (serve_checks.sh part tiny: tiny dense and MoE models, 1 rank, TP 2, PP 2, bf16),
# now that decode steps chain by default; (2) the 8B at 4 streams, fp8 and bf16, the chain (default) against
# Q3VL_DECODE_CHAIN=0: at 4 rows the 8B's down_proj input is over the chain kernel's 48 KiB, so its links run one by
# one (16-bit: linear_fwd's RowsIn and add on cuBLASLt), which must not be slower than before.
source tools/gpu/call_lib.sh call7h
t1=$SECONDS
timeout 260 bash tools/gpu/serve_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/sc_tiny "tiny" > /dev/null 2>&1
mkdir -p "$out/tiny"; tar xzf /tmp/sc_tiny/results.tgz -C "$out/tiny" 2>/dev/null
say "tiny $((SECONDS - t1)) s:"; grep -E "^tiny" "$out/tiny/summary.txt" >> "$out/summary.txt"; pack
four() {
  local n=$1 p=$2 t=$3 t1=$SECONDS; shift 3
  rm -rf /tmp/results
  env CONC=4 "$@" timeout "$t" bash tools/gpu/serve_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/sc_$n "$p" > /dev/null 2>&1
  mkdir -p "$out/$n"; tar xzf /tmp/sc_$n/results.tgz -C "$out/$n" 2>/dev/null
  say "$n ($*) $((SECONDS - t1)) s: $(grep -h 'c=4' "$out/$n/summary.txt" | head -2 | tr '\n' ' ')"
  say "$n: $(grep -ho 'decode-only steps [^;]*' "$out/$n/summary.txt")"; pack
}
left 50 && four fp8_c4 8bfp8 50
left 50 && four fp8_c4_nochain 8bfp8 50 Q3VL_DECODE_CHAIN=0
left 60 && four bf16_c4 8b 60
left 60 && four bf16_c4_nochain 8b 60 Q3VL_DECODE_CHAIN=0
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
