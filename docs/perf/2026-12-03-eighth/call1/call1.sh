#!/usr/bin/env bash
# call 1 (2026-12-03, eighth session), q3vl at 19270b0 (training numerics as today's head): the video demo's recipe
# sweep (tools/gpu/video_demo_sweep.sh): stage 2 as the deck (3000 steps, batch 4, lr 7e-4), at batch 8, at lr 1.4e-3,
# and at batch 8 with lr 1e-3, each from make demo's picture model of seeds 1234, 2 and 3.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh && tar xJf devpack/tok.tar.xz
out=/tmp/res1 final=$OUT; mkdir -p $out
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
pack() { tar czf "$final/results.tgz" -C "$out" . ; cp $out/summary.txt $final/ 2>/dev/null; }
nvidia-smi -L > $out/summary.txt; nproc >> $out/summary.txt
v=""
for s in 1234 2 3; do
  v="$v c$s:$s b8s$s:$s:train.global_batch=8 lr$s:$s:train.lr=1.4e-3 b8lr$s:$s:train.global_batch=8+train.lr=1e-3"
done
VARIANTS="$v" BUDGET_S=530 NP_PREP=4 timeout 560 bash tools/gpu/video_demo_sweep.sh /tmp/rt/bin/q3vl /tmp/vs > $out/sweep.log 2>&1 &
sw=$!
while kill -0 $sw 2>/dev/null; do sleep 15; mkdir -p $out/vs; cp /tmp/vs/summary.txt /tmp/vs/results.tgz $out/vs/ 2>/dev/null; pack; done
cp /tmp/vs/summary.txt /tmp/vs/results.tgz $out/vs/ 2>/dev/null
echo "done $((SECONDS-T0)) s" >> $out/summary.txt; pack
