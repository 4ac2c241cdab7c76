#!/usr/bin/env bash
# call 8h (thirty-first session; ran on an H100 at 17:31 UTC): binaries of 4a566c7 (as calls 6 and 7h). One stream of the 8B fp8 with the chain,
# its decode steps profiled op by op (PROFILE=2: serve.profile_steps, no graphs): how much of a chained step is the
# attention's kernels (qkv_to_cache, paged attention and its combine) against the chains: the next step's question.
source tools/gpu/call_lib.sh call8h
serve_one fp8_prof 8bfp8 80 PROFILE=2 PROFILE_ROWS=1
sed -n '/decode-only step of 1 rows/,/compute stream busy/p' "$out"/fp8_prof/profile_8b-fp8.txt | head -40 >> "$out/summary.txt"
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
