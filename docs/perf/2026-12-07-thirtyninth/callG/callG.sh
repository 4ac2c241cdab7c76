#!/usr/bin/env bash
# call G (thirty-ninth session, the last ~300 s of its device time, either kind; binaries of f664d3f): the op table's
# adamw, sum_squares, sum_slots and grouped cases on the GPU against the CPU reference (fp32 and bf16).
source tools/gpu/call_lib.sh callG
Q3VL_OPS=adamw,sum_squares,sum_slots,grouped unit_gpu 'BackendOps.Fp32:BackendOps.Bf16' 60
say "done $((SECONDS - T0)) s"; pack
cat "$out/summary.txt"
