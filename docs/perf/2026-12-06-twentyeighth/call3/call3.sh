#!/usr/bin/env bash
# call 3 (twenty-eighth session, binaries of the session's head): (1) train_checks.sh part overlap1 (the overlap, now
# the default, with its plan made once: the demo's losses against Q3VL_OVERLAP_UPDATE=0 at bound 0); (2) the op
# table's 8-bit linear cases and DevInfer.* with the whole-matrix dequantization for prefill chunks; (3) one stream of
# the 8B fp8 profiled op by op (a mixed step of a whole prompt, then decode steps), by default and with
# Q3VL_Q8_TILE_MIB=32 (the former 32 MiB tiles), then the 8B bf16 the same way. Each step only while the call has room.
source tools/gpu/call_lib.sh call3
t1=$SECONDS
timeout 60 bash tools/gpu/train_checks.sh "$q" /tmp/rt/bin/unit_tests /tmp/tc_overlap overlap1 > /dev/null 2>&1
mkdir -p "$out/overlap" && tar xzf /tmp/tc_overlap/results.tgz -C "$out/overlap" 2>/dev/null
say "overlap1 $((SECONDS - t1)) s: $(grep -hE 'PASS|FAIL|rc=' "$out/overlap/summary.txt" | tr '\n' ';')"; pack
Q3VL_OPS=linear_q8 unit_gpu 'BackendOps.*:DevInfer.*' 120
left 70 && serve_one fp8 8bfp8 65 PROFILE=2 PROFILE_ROWS=1
left 70 && serve_one fp8_t32 8bfp8 65 PROFILE=2 PROFILE_ROWS=1 Q3VL_Q8_TILE_MIB=32
left 70 && serve_one bf16 8b 65 PROFILE=2 PROFILE_ROWS=1
for n in fp8 fp8_t32 bf16; do
  [[ -f $out/$n/summary.txt ]] && say "$n: $(grep -ho 'mixed steps [^;]*' "$out/$n/summary.txt")"
  f=$(ls "$out/$n"/profile_*.txt 2>/dev/null | head -1)
  [[ -n $f ]] && say "$n: $(sed -n '/a mixed step/,/compute stream/p' "$f" | grep -E 'linear' | head -5 | tr -s ' ' | cut -d' ' -f2-5 | tr '\n' ';')"
done
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
