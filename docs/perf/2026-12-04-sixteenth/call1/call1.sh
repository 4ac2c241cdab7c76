#!/usr/bin/env bash
# call 1 (sixteenth session): fwd_ws (the warp-specialized TMA forward) checked against the fp64 reference and timed
# against fwd_wgmma; where the wgmma backward's time goes: attn_check_vN is bin/attn_check linked with
# attention_sm90.cu built with -DQ3_ABL=N (ablations.patch here, on the file at e24efce): 0 as is;
# 1 the backward without its dQ atomics; 2 without the dQ product (and its barrier and atomics); 3 float4 dQ atomics
# (lanes t, t^1 swap halves: checked too); 4 the backward without loads after its first tiles; 5 the forward without
# loads. Timings only (wrong results) except 0 and 3. Then the op table (rope_table on CUDA) and the 2B step with its
# rotary tables built on the device, with either forward.
source tools/gpu/call_lib.sh res1
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check > $out/ws.txt 2>&1
say "attn_check (fwd_ws) rc=$? $((SECONDS-t1)) s"; grep FAIL $out/ws.txt | head -5 >> $out/summary.txt; pack
t1=$SECONDS; Q3VL_ATTN_FWD=wgmma timeout 60 /tmp/rt/bin/attn_check --no-checks --fwd-only > $out/wg.txt 2>&1
say "attn_check (fwd_wgmma) rc=$? $((SECONDS-t1)) s"; pack
for v in 0 1 2 4 5; do
  t1=$SECONDS; timeout 100 /tmp/rt/bin/attn_check_v$v --no-checks > $out/abl$v.txt 2>&1
  say "abl$v rc=$? $((SECONDS-t1)) s"; pack
done
t1=$SECONDS; timeout 150 /tmp/rt/bin/attn_check_v3 > $out/abl3.txt 2>&1
say "abl3 (checked) rc=$? $((SECONDS-t1)) s"; grep FAIL $out/abl3.txt | head -5 >> $out/summary.txt; pack
unit_gpu 'BackendOps.*' 150
Q3VL_ATTN_FWD=wgmma train_prof q2b input/bench_2b_gpu.deck 150 run.profile_top=0
train_prof q2b_ws input/bench_2b_gpu.deck 150 run.profile_top=0
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt
for f in ws wg abl0 abl1 abl2 abl3 abl4 abl5; do echo "== $f"; grep -A11 "^case (median" $out/$f.txt | head -11; done
head -30 $out/q2b_profile.txt; head -12 $out/q2b_ws_profile.txt
