#!/usr/bin/env bash
# call 4 (2026-12-02, fifth session): the 2B step's per-op profile with the loader's prefetch (run.profile = true)
set -u
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
q=/tmp/rt/bin/q3vl ut=/tmp/rt/bin/unit_tests final=$OUT out=/tmp/res4
mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
nvidia-smi -L > $out/summary.txt
timeout 200 bash tools/gpu/train_checks.sh $q $ut /tmp/tc "profile"
mkdir -p $out/tc; tar xzf /tmp/tc/results.tgz -C $out/tc 2>/dev/null; cat /tmp/tc/summary.txt >> $out/summary.txt; pack
cat $out/summary.txt
