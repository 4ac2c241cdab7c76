#!/usr/bin/env bash
# call 3 (2026-12-02, sixth session): the 2B step against transformers in one call (the fusions, the wgmma forward);
# the decode GEMV against the old one and cuBLASLt; 8B serving at 1 and 64 streams (the engine's time breakdown) and
# fp8 at one stream (the new 8-bit GEMV).
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl out=/tmp/res3 final=$OUT; mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
timeout 60 /tmp/rt/bin/gemv_bench 100 > $out/gemv.txt 2>&1; say "gemv_bench rc=$? $((SECONDS-T0)) s"; grep FAIL $out/gemv.txt | head -5 >> $out/summary.txt; pack
timeout 300 bash tools/gpu/train_checks.sh $q none /tmp/tc "hftrain"
mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; cat /tmp/tc/summary.txt >> $out/summary.txt; say "hftrain done $((SECONDS-T0)) s"; pack
CONC="1 64" timeout 130 bash tools/gpu/serve_checks.sh $q none /tmp/sc8 "8b"
mkdir -p $out/sc8; tar xzf /tmp/sc8/results.tgz -C $out/sc8 2>/dev/null; cat /tmp/sc8/summary.txt >> $out/summary.txt; pack
CONC="1" timeout 90 bash tools/gpu/serve_checks.sh $q none /tmp/scf "8bfp8"
mkdir -p $out/scf; tar xzf /tmp/scf/results.tgz -C $out/scf 2>/dev/null; cat /tmp/scf/summary.txt >> $out/summary.txt; pack
say "done $((SECONDS-T0)) s"; pack
cat $out/summary.txt; grep -h "engine over" $out/sc8/*.txt $out/scf/*.txt 2>/dev/null; tail -25 $out/gemv.txt
