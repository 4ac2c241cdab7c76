#!/usr/bin/env bash
# `q3vl train` end to end on the CPU with a 240k-parameter model (tests/data/golden/dense_tied/model) and the
# synthetic dataset: the same global batch gives the same losses and weights on 1, 2 and 4 ranks, for any
# micro-batch x accumulation split and ZeRO stage; a stopped and resumed run is bitwise identical to a straight
# one (and agrees when resumed on another rank count); activation recomputation changes no bit; hybrid sharding over
# two (MPICH clique) nodes matches flat sharding; the ZeRO state per rank shrinks with the ranks; non-finite steps are
# skipped, then stop the run; frozen
# parts stay as loaded; a checkpoint of another model is refused.
source "$(dirname "$0")/../lib.sh"
model=tests/data/golden/dense_tied/model
common=(model.hf=$model data.seq_len=32 train.global_batch=8 train.steps=20 train.lr=5e-4 train.micro_batch=4
        optim.warmup_steps=2
        optim.weight_decay=0.1 train.resume=never)

# train NAME NP ARGS...: run into $tmp/NAME; the log is kept in $tmp/NAME.log.
train() {
  local name=$1 np=$2; shift 2
  mpiexec -n "$np" $q train "${common[@]}" run.out_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1
}

# (a) 1, 2 and 4 ranks, ZeRO-3, same global batch: losses and final weights and moments agree.
for n in 1 2 4; do train np$n $n parallel.zero_stage=3; ok_run $? np$n; done
for n in 2 4; do
  if cmp_losses np$n np1 1e-5 && cmp_ckpt "$(ckpt np$n)" "$(ckpt np1)" 1e-5; then pass "ranks-$n-vs-1"; else bad "ranks-$n-vs-1"; fi
done
# The ZeRO state per rank by kind (the "memory per rank" line, rank 0's: fp32 masters, AdamW moments, gradient shard)
# at 2 and 4 ranks is 1/2 and 1/4 of one rank's (each unit padded to the group: within 1%).
if $py - "$tmp/np1.log" "$tmp/np2.log" "$tmp/np4.log" <<'PY'
import re, sys
def state(path):
    line = next(l for l in open(path) if "memory per rank" in l and "fp32 masters" in l)
    return [float(re.search(k + r" ([0-9.]+) MiB", line).group(1)) for k in ("fp32 masters", "AdamW moments", "gradient shard")]
one = state(sys.argv[1])
for n, path in ((2, sys.argv[2]), (4, sys.argv[3])):
    got = state(path)
    assert all(o > 0 and abs(g * n / o - 1) < 0.01 for o, g in zip(one, got)), (n, one, got)
PY
then pass "memory-zero-state-by-ranks"; else bad "memory-zero-state-by-ranks: $(grep -h 'memory per rank' "$tmp"/np[124].log)"; fi
# The loss goes down.
$py -c "import json,sys; l=[json.loads(x)['loss'] for x in open('$tmp/np1/metrics.jsonl')]; sys.exit(not sum(l[-5:]) < sum(l[:5]) - 0.2)" \
  && pass "loss-decreases" || bad "loss-decreases"

# (b) micro 4 x accum 1 vs 2 x 2 vs 1 x 4 on 2 ranks.
train acc41 2 train.micro_batch=4 train.grad_accum=1; ok_run $? acc41
for s in "2 2" "1 4"; do
  set -- $s
  train acc$1$2 2 train.micro_batch=$1 train.grad_accum=$2 && cmp_losses acc$1$2 acc41 1e-5 \
    && pass "micro-$1-accum-$2" || bad "micro-$1-accum-$2"
done

# (e) ZeRO stages 1 and 2 against stage 3 (np2 ran stage 3).
for st in 1 2; do
  train stage$st 2 parallel.zero_stage=$st && cmp_losses stage$st np2 1e-5 \
    && cmp_ckpt "$(ckpt stage$st)" "$(ckpt np2)" 1e-5 && pass "stage-$st-vs-3" || bad "stage-$st-vs-3"
done

# (g) Activation recomputation per block (2 ranks, ZeRO-3): bitwise the same run, fewer activation bytes kept.
train recompute 2 parallel.zero_stage=3 train.recompute=block; ok_run $? recompute
if cmp_losses recompute np2 0 && cmp_ckpt "$(ckpt recompute)" "$(ckpt np2)" 0 &&
   $py - "$tmp/recompute/metrics.jsonl" "$tmp/np2/metrics.jsonl" <<'PY'
import json, sys
r, k = ([json.loads(l)["memory_mib"]["activations"] for l in open(f)] for f in sys.argv[1:3])
# The activation arena: every layer's context becomes one shared one (the head's and the scratch buffers stay).
assert all(0 < a < 0.9 * b for a, b in zip(r, k)), f"activations kept, recompute vs not: {r[:3]} vs {k[:3]} MiB"
PY
then pass "recompute-bitwise-less-memory"; else bad "recompute-bitwise-less-memory"; fi
grep -q "activation recomputation: block" "$tmp/recompute.log" || bad "recompute-logged"

# (h) bf16 gathers: 1 vs 4 ranks agree (losses to 1e-5; the state looser: a master that differs from the other
# run's in the last fp32 bit sometimes rounds to the neighbouring bf16 value, and AdamW's moments carry that);
# half the gathered bytes; the loss really changes (a little). One rank with fp32 gathers gathers nothing: the model
# computes with the parameter copy itself.
train bf16_1 1 parallel.gather_dtype=bf16; ok_run $? bf16_1
train bf16_4 4 parallel.gather_dtype=bf16; ok_run $? bf16_4
if cmp_losses bf16_4 bf16_1 1e-5 && cmp_ckpt "$(ckpt bf16_4)" "$(ckpt bf16_1)" 2e-4 &&
   $py - "$tmp/bf16_4/metrics.jsonl" "$tmp/np4/metrics.jsonl" "$tmp/np1/metrics.jsonl" <<'PY'
import json, sys
h, f, one = ([json.loads(l) for l in open(p)] for p in sys.argv[1:4])
assert all(abs(a["gathered_mib"] * 2 - b["gathered_mib"]) < 1e-9 and b["gathered_mib"] > 0 for a, b in zip(h, f))
assert all(a["gathered_mib"] == 0 for a in one)
d = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(h, f)]
assert all(0 <= x < 2e-2 for x in d) and max(d) > 0, f"bf16 vs fp32 gathers: loss differences {d[:5]}"  # NaN fails
PY
then pass "bf16-gathers"; else bad "bf16-gathers"; fi

# (i) Hybrid sharding through the real node detection: MPICH's cliques make 4 ranks look like 2 nodes of 2
# (MPI_COMM_TYPE_SHARED follows them), so shards span a node and gradients are all-reduced across the two.
MPIR_CVAR_NUM_CLIQUES=2 train hybrid 4 parallel.zero_stage=3 parallel.hybrid=true; ok_run $? hybrid
if grep -q "4 rank(s) on 2 node(s)" "$tmp/hybrid.log" && grep -q "2-way shards, hybrid" "$tmp/hybrid.log" &&
   cmp_losses hybrid np4 1e-5 && cmp_ckpt "$(ckpt hybrid)" "$(ckpt np4)" 1e-5; then pass "hybrid-2-nodes-vs-flat"
else bad "hybrid-2-nodes-vs-flat: $(grep -E 'node|shards' "$tmp/hybrid.log" | head -3)"; fi

# (c) 10 steps, stop, resume for 10 more (2 ranks): bitwise equal to 20 straight; 10 steps on 4 ranks resumed on 2:
# same losses and weights.
train half 2 train.stop_after=10 checkpoint.keep=5; ok_run $? half
train half4 4 train.stop_after=10; ok_run $? half4
mpiexec -n 2 $q train "${common[@]}" run.out_dir="$tmp/half" train.resume=auto >"$tmp/resume2.log" 2>&1; ok_run $? resume2
if grep -q "resumed from .*step_00000010.h5" "$tmp/resume2.log" && cmp_ckpt "$(ckpt half)" "$(ckpt np2)" 0 &&
   cmp_losses half np2 0; then pass "resume-bitwise"; else bad "resume-bitwise"; fi
mpiexec -n 2 $q train "${common[@]}" run.out_dir="$tmp/half4" train.resume="$tmp/half4/checkpoints/step_00000010.h5" \
  >"$tmp/resume42.log" 2>&1; ok_run $? resume42
cmp_losses half4 np2 1e-5 && cmp_ckpt "$(ckpt half4)" "$(ckpt np2)" 1e-5 && pass "resume-on-2-of-4-ranks" || bad "resume-on-2-of-4-ranks"
# A colon in the run folder (ROMIO reads "name:" as a file-system type): checkpoints are written and resumed.
train "colon:dir" 2 train.steps=2 checkpoint.every=1; ok_run $? "colon:dir"
mpiexec -n 2 $q train "${common[@]}" run.out_dir="$tmp/colon:dir" train.steps=3 train.resume=auto \
  >"$tmp/colon2.log" 2>&1; ok_run $? colon2
grep -q "resumed from .*colon:dir/checkpoints/step_00000002.h5" "$tmp/colon2.log" && pass "colon-in-path" ||
  bad "colon-in-path: $(grep -iE 'error|resum' "$tmp/colon:dir.log" "$tmp/colon2.log" | head -3)"
# Metrics: only the first line after the resume says "resumed"; time.wall carries over and grows; mfu is a
# fraction computed from the logged FLOP count.
$py - "$tmp/half4/metrics.jsonl" <<'PY' && pass "metrics-resumed-wall-mfu" || bad "metrics-resumed-wall-mfu"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
assert [x["step"] for x in r if x.get("resumed")] == [11], [x.get("resumed") for x in r]
w = [x["time"]["wall"] for x in r]
assert all(b > a for a, b in zip(w, w[1:])), w
for x in r:
    f = x["flops"]
    assert f["model"] > 0 and 0 < x["mfu"] < 1
    assert abs(x["mfu"] - f["model"] / x["time"]["step"] / (f["peak_per_rank"] * f["ranks"])) <= 1e-9 * x["mfu"] + 1e-12
PY

# (f) a poisoned step is skipped and changes nothing (constant lr: 3 steps with step 3 skipped == 2 steps);
# too many in a row stop the run with a clear message.
train two 1 train.steps=2 optim.schedule=constant; ok_run $? two
train skip3 1 train.steps=3 optim.schedule=constant train.debug_nan_step=3; ok_run $? skip3
if $py -c "import json,sys; r=[json.loads(x) for x in open('$tmp/skip3/metrics.jsonl')]; sys.exit(not (r[2]['skipped'] and r[2]['skipped_total']==1 and not r[1]['skipped']))" &&
   $py - "$(ckpt skip3)" "$(ckpt two)" <<'PY'
import h5py, numpy as np, sys
with h5py.File(sys.argv[1]) as a, h5py.File(sys.argv[2]) as b:
    names = []
    a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    for n in names:
        assert np.array_equal(a[n][()], b[n][()]), n
PY
then pass "nan-step-skipped"; else bad "nan-step-skipped"; fi
train nanstop 2 train.debug_nan_step=2 train.debug_nan_count=10 train.max_skipped=3
rc=$?
if [[ $rc -eq 1 ]] && grep -q "step 4: 3 steps in a row had a non-finite loss or gradient (train.max_skipped = 3)" "$tmp/nanstop.log"; then
  pass "nan-stops-run"
else
  bad "nan-stops-run: rc=$rc: $(tail -3 "$tmp/nanstop.log")"
fi

# (k) Optimizer offload (parallel.offload_optimizer = cpu, issue 29): masters and moments on the host, AdamW on the
# rank's threads (3 here, so the split over threads is exercised; the copies through a ring of 1000-element chunks,
# so runs cross chunk ends) with the CPU op layer's arithmetic: every run is bitwise the same run without offload
# (losses and checkpoints) — 1 and 2 ranks ZeRO-3, stages 1 and 2, gradient accumulation, hybrid sharding, bf16
# gathers (the host's rounding) and a skipped non-finite step; a run stopped with offload resumes without it and the
# other way round, on the uninterrupted run's curve.
off=(parallel.offload_optimizer=cpu parallel.offload_threads=3 parallel.offload_chunk=1000)
offload_case() {  # NAME REF NP ARGS...: run NAME with offload, bitwise equal to run REF without it
  local name=$1 ref=$2 np=$3; shift 3
  train "$name" "$np" "${off[@]}" "$@" || { ok_run 1 "$name"; return; }
  if grep -q "optimizer offloaded to the host" "$tmp/$name.log" && cmp_losses "$name" "$ref" 0 &&
     cmp_ckpt "$(ckpt "$name")" "$(ckpt "$ref")" 0; then pass "offload-$name-bitwise"; else bad "offload-$name-bitwise"; fi
}
offload_case off_np1 np1 1 parallel.zero_stage=3
offload_case off_np2 np2 2 parallel.zero_stage=3
offload_case off_stage1 stage1 2 parallel.zero_stage=1
offload_case off_stage2 stage2 2 parallel.zero_stage=2
offload_case off_acc22 acc22 2 train.micro_batch=2 train.grad_accum=2
MPIR_CVAR_NUM_CLIQUES=2 offload_case off_hybrid hybrid 4 parallel.zero_stage=3 parallel.hybrid=true
offload_case off_bf16_4 bf16_4 4 parallel.gather_dtype=bf16
offload_case off_skip3 skip3 1 train.steps=3 optim.schedule=constant train.debug_nan_step=3
# Partial offload (parallel.offload_ratio < 1): the host updates the first part of each rank's trained elements, the
# device the rest (the run at the boundary split); bitwise the run without offload, checkpoints and a resume too.
offload_case off_part_np1 np1 1 parallel.zero_stage=3 parallel.offload_ratio=0.37
offload_case off_part_np2 np2 2 parallel.zero_stage=3 parallel.offload_ratio=0.5
offload_case off_part_stage1 stage1 2 parallel.zero_stage=1 parallel.offload_ratio=0.8
offload_case off_part_bf16_4 bf16_4 4 parallel.gather_dtype=bf16 parallel.offload_ratio=0.25
if grep -q "partial offload: [0-9]* of [0-9]* trained elements updated on the device" "$tmp/off_part_np1.log"; then
  pass "offload-partial-reported"; else bad "offload-partial-reported: $(grep -h 'offloaded' "$tmp/off_part_np1.log")"; fi
train off_part_half 2 "${off[@]}" parallel.offload_ratio=0.5 train.stop_after=10; ok_run $? off_part_half
mpiexec -n 2 $q train "${common[@]}" "${off[@]}" parallel.offload_ratio=0.3 run.out_dir="$tmp/off_part_half" \
  train.resume=auto >"$tmp/off_part_resume.log" 2>&1
if grep -q "resumed from .*step_00000010.h5" "$tmp/off_part_resume.log" && cmp_losses off_part_half np2 0 20 &&
   cmp_ckpt "$(ckpt off_part_half)" "$(ckpt np2)" 0; then pass "offload-partial-resumes-at-another-ratio"
else bad "offload-partial-resumes-at-another-ratio: $(tail -2 "$tmp/off_part_resume.log")"; fi
train off_half 2 "${off[@]}" train.stop_after=10; ok_run $? off_half
mpiexec -n 2 $q train "${common[@]}" run.out_dir="$tmp/off_half" train.resume=auto >"$tmp/off_resume.log" 2>&1
ok_run $? off_resume
if grep -q "resumed from .*step_00000010.h5" "$tmp/off_resume.log" && ! grep -q "optimizer offloaded" "$tmp/off_resume.log" &&
   cmp_losses off_half np2 0 20 && cmp_ckpt "$(ckpt off_half)" "$(ckpt np2)" 0; then pass "offload-resumes-without"
else bad "offload-resumes-without"; fi
train on_half 2 train.stop_after=10; ok_run $? on_half
mpiexec -n 2 $q train "${common[@]}" "${off[@]}" run.out_dir="$tmp/on_half" train.resume=auto >"$tmp/on_resume.log" 2>&1
ok_run $? on_resume
if grep -q "resumed from .*step_00000010.h5" "$tmp/on_resume.log" && grep -q "optimizer offloaded" "$tmp/on_resume.log" &&
   cmp_losses on_half np2 0 20 && cmp_ckpt "$(ckpt on_half)" "$(ckpt np2)" 0; then pass "no-offload-resumes-with"
else bad "no-offload-resumes-with"; fi
# Delayed update (parallel.offload_update = delayed): step k's host AdamW overlaps step k+1, which computes on the
# weights from before it. Step 1 is the synchronous run's; step 2 still runs on the initial weights, so its loss is
# bitwise that of a run whose weights never move (train.lr = 0), and step 3's is not (the first update landed);
# 2 ranks give 1 rank's run; a run stopped at a checkpoint and resumed is bitwise the straight run that wrote
# checkpoints at the same steps (a checkpoint lands the update in flight); and it learns.
dly=("${off[@]}" parallel.offload_update=delayed checkpoint.every=5)
train lr0 1 train.lr=0 train.steps=4; ok_run $? lr0
train dly1 1 "${dly[@]}"; ok_run $? dly1
if grep -q "update delayed a step" "$tmp/dly1.log" && $py - "$tmp/dly1/metrics.jsonl" "$tmp/np1/metrics.jsonl" "$tmp/lr0/metrics.jsonl" <<'PY'
import json, sys
d, s, z = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:4])
assert d[0] == s[0], ("step 1", d[0], s[0])
assert d[1] == z[1] and d[1] != s[1], ("step 2 on the initial weights", d[1], z[1], s[1])
assert d[2] != z[2], ("step 3 on the first update's weights", d[2], z[2])
assert sum(d[-5:]) < sum(d[:5]) - 0.2, ("learns", d)
PY
then pass "delayed-update-steps"; else bad "delayed-update-steps"; fi
train dly2 2 "${dly[@]}" && cmp_losses dly2 dly1 1e-5 && cmp_ckpt "$(ckpt dly2)" "$(ckpt dly1)" 1e-5 \
  && pass "delayed-update-ranks-2-vs-1" || bad "delayed-update-ranks-2-vs-1"
train dly_half 2 "${dly[@]}" train.stop_after=10; ok_run $? dly_half
mpiexec -n 2 $q train "${common[@]}" "${dly[@]}" run.out_dir="$tmp/dly_half" train.resume=auto >"$tmp/dly_resume.log" 2>&1
if grep -q "resumed from .*step_00000010.h5" "$tmp/dly_resume.log" && cmp_losses dly_half dly2 0 20 &&
   cmp_ckpt "$(ckpt dly_half)" "$(ckpt dly2)" 0; then pass "delayed-update-resumes-bitwise"
else bad "delayed-update-resumes-bitwise: $(tail -2 "$tmp/dly_resume.log")"; fi
# Delayed with partial offload: the device's part is updated at once, so step 2 no longer runs on the initial
# weights (as the fully delayed run's does); 2 ranks give 1 rank's run, and it learns.
train dlyp1 1 "${dly[@]}" parallel.offload_ratio=0.5; ok_run $? dlyp1
if $py - "$tmp/dlyp1/metrics.jsonl" "$tmp/np1/metrics.jsonl" "$tmp/lr0/metrics.jsonl" "$tmp/dly1/metrics.jsonl" <<'PY'
import json, sys
d, s, z, f = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:5])
assert d[0] == s[0], ("step 1", d[0], s[0])
assert d[1] != z[1] and d[1] != f[1], ("step 2 sees the device's part updated", d[1], z[1], f[1])
assert sum(d[-5:]) < sum(d[:5]) - 0.2, ("learns", d)
PY
then pass "delayed-partial-steps"; else bad "delayed-partial-steps"; fi
train dlyp2 2 "${dly[@]}" parallel.offload_ratio=0.5 && cmp_losses dlyp2 dlyp1 1e-5 &&
  cmp_ckpt "$(ckpt dlyp2)" "$(ckpt dlyp1)" 1e-5 && pass "delayed-partial-ranks-2-vs-1" || bad "delayed-partial-ranks-2-vs-1"
expect offload-ratio-needs-offload 1 'parallel.offload_ratio below 1 needs parallel.offload_optimizer = "cpu"' \
  $q train "${common[@]}" parallel.offload_ratio=0.5 run.out_dir="$tmp/ratio_bad"
expect delayed-needs-offload 1 'parallel.offload_update = "delayed" needs parallel.offload_optimizer = "cpu"' \
  $q train "${common[@]}" parallel.offload_update=delayed run.out_dir="$tmp/dly_bad"
# A node without the host memory is refused before anything is allocated, naming the key and both sizes (the 8B
# preset's shards on one rank: far more than this machine has).
expect offload-host-memory-refused 1 \
  'parallel.offload_optimizer = "cpu" needs [0-9.]+ GiB of host memory per node \(1 rank\(s\) here.*has [0-9.]+ GiB available \(MemAvailable\)' \
  $q train "${common[@]}" model.hf= model.preset=8B "${off[@]}" run.out_dir="$tmp/off_8b"
# Pinned host memory refused (a memlock limit, the driver): one message naming the key and the size, before a step.
expect offload-pin-refused 1 \
  'parallel.offload_optimizer = "cpu": pinning [0-9.]+ MiB of host memory was refused.*ulimit -l' \
  env Q3VL_DEBUG_PIN_LIMIT_MIB=0.001 $q train "${common[@]}" "${off[@]}" run.out_dir="$tmp/off_pin"
expect offload-bad-value 1 'parallel.offload_optimizer.*"none", "cpu"' \
  $q train "${common[@]}" parallel.offload_optimizer=gpu run.out_dir="$tmp/off_bad"

# Freezing: vision frozen keeps the loaded vision weights and writes no vision optimizer state.
train frozen 2 train.steps=3 train.tune_vision=false; ok_run $? frozen
if $py - "$(ckpt frozen)" "$model/model.safetensors" <<'PY'
import h5py, json, numpy as np, struct, sys
raw = open(sys.argv[2], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
def st(name):
    h = hdr[name]; a, b = h["data_offsets"]
    return np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(h["shape"])
with h5py.File(sys.argv[1]) as f:
    v = "model.visual.blocks.0.attn.qkv.weight"
    assert np.array_equal(f["model/" + v][()], st(v)), "frozen vision weight changed"
    assert "optim/exp_avg/" + v not in f, "frozen tensor has optimizer state"
    t = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(f["model/" + t][()], st(t)), "trained weight did not change"
    assert "optim/exp_avg/" + t in f
PY
then pass "freeze-vision"; else bad "freeze-vision"; fi

# (j) A 4-rank checkpoint resumes on one rank and continues the curve.
cp -r "$tmp/half4" "$tmp/half41"
rm -f "$tmp/half41/checkpoints/step_00000020.h5"
head -10 "$tmp/half4/metrics.jsonl" >"$tmp/half41/metrics.jsonl"  # the 4-rank steps, without the 2-rank resume's
mpiexec -n 1 $q train "${common[@]}" run.out_dir="$tmp/half41" train.resume="$tmp/half41/checkpoints/step_00000010.h5" \
  >"$tmp/resume41.log" 2>&1; ok_run $? resume41
cmp_losses half41 np1 1e-5 && cmp_ckpt "$(ckpt half41)" "$(ckpt np1)" 1e-5 && pass "resume-on-1-of-4-ranks" ||
  bad "resume-on-1-of-4-ranks"

# A checkpoint of a model with the same shapes but another RoPE base is refused, naming the key.
mkdir -p "$tmp/theta" && cp $model/* "$tmp/theta/" &&
  sed -i 's/"rope_theta": 5000000.0/"rope_theta": 10000.0/' "$tmp/theta/config.json"
expect resume-refuses-other-config 1 \
  "different model configuration: text_config.rope_theta: 5000000.0 in the checkpoint, 10000.0 here" \
  mpiexec -n 2 $q train "${common[@]}" model.hf="$tmp/theta" run.out_dir="$tmp/theta_run" train.resume="$(ckpt np2)"
# A checkpoint of another model (untied head: lm_head.weight) is refused, naming the tensor.
mpiexec -n 2 $q train "${common[@]}" model.hf=tests/data/golden/dense_untied/model run.out_dir="$tmp/other" \
  train.resume="$(ckpt np2)" >"$tmp/other.log" 2>&1
rc=$?
if [[ $rc -eq 1 ]] && grep -q "written for a different model: tensor model/" "$tmp/other.log"; then
  pass "resume-refuses-other-model"
else
  bad "resume-refuses-other-model: rc=$rc: $(tail -3 "$tmp/other.log")"
fi
# train.micro_batch past a rank's share of the global batch (8 over 2 ranks: 4 a micro-step) is said and lowered:
# the same losses, bitwise, as micro_batch = 4 (issue 33).
train mb8 2 train.micro_batch=8 train.steps=3; ok_run $? mb8
train mb4 2 train.micro_batch=4 train.steps=3; ok_run $? mb4
grep -q "train.micro_batch = 8 is more than the 4 sample(s) a rank gets per micro-step (train.global_batch = 8 over 2 rank(s), train.grad_accum = 1): using 4" \
  "$tmp/mb8.log" && cmp_losses mb8 mb4 0 3 && pass "micro-batch-past-share-said-and-lowered" ||
  bad "micro-batch-past-share-said-and-lowered: $(grep -E 'micro_batch|error' "$tmp/mb8.log")"

# (l) data.prefetch (issue 30, on by default): the next step's batch, built on a thread while the step computes, changes
# no bit: 20 steps over epochs of 36 samples (boundaries in steps 5, 10, 14 and 19), 2 ranks with accumulation, with
# and without it. The checkpoint of step 5, written with step 6's batch in flight, keeps the consumed batches' cursor
# (40 samples: epoch 1, position 4), and runs resumed from it, with prefetch and without, go on bitwise on the
# straight run's curve.
pf=(train.synthetic_samples=36 train.micro_batch=2 train.grad_accum=2 checkpoint.every=5 checkpoint.keep=5)
train pf_on 2 "${pf[@]}"; ok_run $? pf_on
train pf_off 2 "${pf[@]}" data.prefetch=false; ok_run $? pf_off
cmp_losses pf_on pf_off 0 20 && cmp_ckpt "$(ckpt pf_on)" "$(ckpt pf_off)" 0 && pass "prefetch-bitwise" ||
  bad "prefetch-bitwise"
if $py - "$tmp/pf_on/checkpoints/step_00000005.h5" "$tmp/pf_on/metrics.jsonl" <<'PY'
import h5py, json, sys
c = json.loads(h5py.File(sys.argv[1]).attrs["state_json"])["cursor"]
assert c == {"epoch": 1, "position": 4}, c
t = [json.loads(l)["time"] for l in open(sys.argv[2])]
assert all(x["data"] >= 0 and x["data_build"] > 0 for x in t), t[:2]
PY
then pass "prefetch-checkpoint-cursor"; else bad "prefetch-checkpoint-cursor"; fi
for on in true false; do
  mkdir -p "$tmp/pf_res_$on" && head -5 "$tmp/pf_on/metrics.jsonl" >"$tmp/pf_res_$on/metrics.jsonl"
  mpiexec -n 2 $q train "${common[@]}" "${pf[@]}" data.prefetch=$on run.out_dir="$tmp/pf_res_$on" \
    train.resume="$tmp/pf_on/checkpoints/step_00000005.h5" >"$tmp/pf_res_$on.log" 2>&1; ok_run $? pf_res_$on
  cmp_losses pf_res_$on pf_off 0 20 && cmp_ckpt "$(ckpt pf_res_$on)" "$(ckpt pf_off)" 0 &&
    pass "prefetch-$on-resumes-bitwise" || bad "prefetch-$on-resumes-bitwise"
done

# (m) optim.update_in_backward (issue 30): with optim.clip = 0 each unit's AdamW runs as the last micro-step's backward
# completes the unit's gradient, instead of after the whole gradient's norm: the same update on the same gradients,
# so bitwise the run without it (losses, weights, moments) on 1 rank, on 2 ranks with accumulation (the units'
# reduce-scatters first), and stopped at step 10 and resumed. A poisoned step (train.debug_nan_step: a NaN in the
# first unit the backward completes) skips that unit alone: its parameters and moments stay as after step 2, the
# other units move on. Clipping, stages 1/2, the offloaded optimizer and hybrid sharding are refused by name (fp16,
# refused too, is a GPU dtype).
train ub_ref1 1 optim.clip=0; ok_run $? ub_ref1
train ub1 1 optim.clip=0 optim.update_in_backward=true; ok_run $? ub1
cmp_losses ub1 ub_ref1 0 20 && cmp_ckpt "$(ckpt ub1)" "$(ckpt ub_ref1)" 0 && pass "update-in-backward-bitwise" ||
  bad "update-in-backward-bitwise"
train ub_ref2 2 optim.clip=0 train.micro_batch=2 train.grad_accum=2; ok_run $? ub_ref2
train ub2 2 optim.clip=0 train.micro_batch=2 train.grad_accum=2 optim.update_in_backward=true; ok_run $? ub2
cmp_losses ub2 ub_ref2 0 20 && cmp_ckpt "$(ckpt ub2)" "$(ckpt ub_ref2)" 0 &&
  pass "update-in-backward-2-ranks-accumulation-bitwise" || bad "update-in-backward-2-ranks-accumulation-bitwise"
train ub_half 2 optim.clip=0 train.micro_batch=2 train.grad_accum=2 optim.update_in_backward=true train.stop_after=10
ok_run $? ub_half
mpiexec -n 2 $q train "${common[@]}" optim.clip=0 train.micro_batch=2 train.grad_accum=2 optim.update_in_backward=true   run.out_dir="$tmp/ub_half" train.resume=auto >"$tmp/ub_resume.log" 2>&1; ok_run $? ub_resume
grep -q "resumed from .*step_00000010.h5" "$tmp/ub_resume.log" && cmp_losses ub_half ub2 0 20 &&
  cmp_ckpt "$(ckpt ub_half)" "$(ckpt ub2)" 0 && pass "update-in-backward-resumes-bitwise" ||
  bad "update-in-backward-resumes-bitwise"
# The MoE golden model through the units' checks (DevTrainer::unit_squares: on a GPU the experts' weight gradients'
# squares come from the grouped GEMM's epilogue, tools/gpu/train_checks.sh's part inbwd; the CPU op layer takes none,
# so here every run is read): the same losses, checkpoint and norm as the update after the norm.
moe=(model.hf=tests/data/golden/moe/model optim.clip=0 train.steps=8)
train ub_moe_ref 1 "${moe[@]}"; ok_run $? ub_moe_ref
train ub_moe 1 "${moe[@]}" optim.update_in_backward=true; ok_run $? ub_moe
cmp_losses ub_moe ub_moe_ref 0 8 && cmp_ckpt "$(ckpt ub_moe)" "$(ckpt ub_moe_ref)" 0 &&
  $py - "$tmp/ub_moe/metrics.jsonl" "$tmp/ub_moe_ref/metrics.jsonl" <<'PY' && pass "update-in-backward-moe-units-checked" || bad "update-in-backward-moe-units-checked"
import json, sys
a, b = ([json.loads(l)["grad_norm"] for l in open(f)] for f in sys.argv[1:3])
assert all(x > 0 and abs(x - y) <= 1e-9 * y for x, y in zip(a, b)), (a, b)  # the same norm, summed in another order
PY
# Q3VL_UPDATE_HOLD=experts: the units completed before the backward has passed the last expert unit updated after
# it, in order: the same updates, so bitwise the run without the hold.
Q3VL_UPDATE_HOLD=experts train ub_moe_hold 1 "${moe[@]}" optim.update_in_backward=true; ok_run $? ub_moe_hold
if grep -q "units held until the backward passed its experts" "$tmp/ub_moe_hold.log" &&
   cmp_losses ub_moe_hold ub_moe 0 8 && cmp_ckpt "$(ckpt ub_moe_hold)" "$(ckpt ub_moe)" 0
then pass "update-in-backward-held-past-the-experts-bitwise"
else bad "update-in-backward-held-past-the-experts-bitwise: $(grep -i 'held' "$tmp/ub_moe_hold.log" | head -2)"; fi
train ub_two 1 optim.clip=0 train.steps=2 optim.schedule=constant; ok_run $? ub_two
train ub_skip 1 optim.clip=0 train.steps=3 optim.schedule=constant train.debug_nan_step=3 optim.update_in_backward=true
ok_run $? ub_skip
if grep -q "step 3: non-finite gradients in 1 of [0-9]* trained units (head): their update skipped" "$tmp/ub_skip.log" &&
   $py - "$(ckpt ub_skip)" "$(ckpt ub_two)" "$tmp/ub_skip/metrics.jsonl" <<'PY'
import h5py, json, numpy as np, sys
r = [json.loads(l) for l in open(sys.argv[3])]
assert r[2]["skipped"] and r[2]["skipped_total"] == 1 and not r[1]["skipped"], r
with h5py.File(sys.argv[1]) as a, h5py.File(sys.argv[2]) as b:
    names = []
    a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    same = {n for n in names if np.array_equal(a[n][()], b[n][()])}
    # the unit "head": the final norm (the LM head is tied to the embedding, another unit)
    w = "model.language_model.norm.weight"
    assert {"model/" + w, "optim/exp_avg/" + w, "optim/exp_avg_sq/" + w} <= same, sorted(same)
    moved = [n for n in names if n.startswith("model/") and n not in same]
    assert "model/model.language_model.embed_tokens.weight" in moved and len(moved) > 50, len(moved)
PY
then pass "update-in-backward-skips-the-nonfinite-unit"; else bad "update-in-backward-skips-the-nonfinite-unit: $(grep -i non-finite "$tmp/ub_skip.log")"; fi
ub_refused() {  # NAME WANT ARGS...: refused before training, naming what it needs
  local name=$1 want=$2; shift 2
  train "$name" 1 optim.update_in_backward=true "$@"
  local rc=$?
  if [[ $rc -ne 0 ]] && grep -q "optim.update_in_backward = true needs $want" "$tmp/$name.log"; then pass "update-in-backward-refuses-${name#ub_no_}"
  else bad "update-in-backward-refuses-${name#ub_no_}: rc=$rc: $(grep -i error "$tmp/$name.log" | head -2)"; fi
}
ub_refused ub_no_clip "optim.clip = 0 (it is 1)"
ub_refused ub_no_stage1 "parallel.zero_stage = 3" optim.clip=0 parallel.zero_stage=1
ub_refused ub_no_offload "the optimizer on the device" optim.clip=0 parallel.offload_optimizer=cpu
MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 4 $q train "${common[@]}" optim.clip=0 optim.update_in_backward=true \
  parallel.hybrid=true run.out_dir="$tmp/ub_hybrid" >"$tmp/ub_hybrid.log" 2>&1
[[ $? -ne 0 ]] && grep -q "optim.update_in_backward = true needs parallel.hybrid = false" "$tmp/ub_hybrid.log" &&
  pass "update-in-backward-refuses-hybrid" || bad "update-in-backward-refuses-hybrid: $(grep -i error "$tmp/ub_hybrid.log" | head -2)"

# run.profile (issue 30): step 2's table in the log and its "profile" object in metrics.jsonl (step 1: none); the
# phases add up to the step, the ops that ran are rows (a ZeRO-3 step on 2 ranks: linear_bwd, MPI gathers), all of
# them with run.profile_top = 0 (no "other" row).
# np1 ran without it: nothing written. Never a timing.
train prof 2 train.steps=2 run.profile=true run.profile_step=2 run.profile_top=0; ok_run $? prof
if grep -q "profile of step 2 (rank 0, CPU op layer" "$tmp/prof.log" && grep -q "host / unaccounted" "$tmp/prof.log" &&
   $py - "$tmp/prof/metrics.jsonl" <<'PY'
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert "profile" not in lines[0] and "profile" in lines[1], [sorted(l) for l in lines]
p = lines[1]["profile"]
assert abs(sum(ph["pct"] for ph in p["phases"]) - 100) < 0.01, p["phases"]
assert p["phases"][-1]["name"] == "host / unaccounted"
ops = {o["name"]: o for o in p["ops"]}
assert ops["linear_bwd"]["calls"] > 0 and ops["linear_bwd"]["tflops"] > 0, ops.get("linear_bwd")
assert any(n.startswith("host waits: mpi all_gather") for n in ops), sorted(ops)
assert len(ops) > 25 and not any(n.startswith("other") for n in ops), sorted(ops)  # more than the default 25
assert all(math.isfinite(v) for o in p["ops"] for v in (o["ms"], o["pct"])), p["ops"]
PY
then pass "profile-table-and-metrics"; else bad "profile-table-and-metrics: $(grep -A3 'profile of' "$tmp/prof.log")"; fi
! grep -q '"profile"' "$tmp/np1/metrics.jsonl" && ! grep -q "profile of step" "$tmp/np1.log" && pass "profile-off-writes-nothing" ||
  bad "profile-off-writes-nothing"

# model.text_layers cuts the preset's depth: one decoder layer fewer is one layer's parameters fewer (tiny: q 64x64,
# k and v 32x64, o 64x64, gate, up and down 128x64, two norms of 64 and q/k norms of 16: 37024); past the depth, or
# a vision depth that drops a DeepStack tap, is refused naming the key.
cut=(model.preset=tiny data.seq_len=32 train.global_batch=2 train.micro_batch=2 train.steps=1 train.resume=never)
for n in 1 2; do
  mpiexec -n 1 $q train "${cut[@]}" model.text_layers=$n run.out_dir="$tmp/cut$n" >"$tmp/cut$n.log" 2>&1; ok_run $? cut$n
done
params() { grep -oP 'model: \K[0-9]+(?= parameters)' "$tmp/$1.log"; }
holds "x[1] - x[0] == 37024" "$(params cut1)" "$(params cut2)" && pass "text-layers-cuts-one-layer" ||
  bad "text-layers-cuts-one-layer: $(params cut1) vs $(params cut2)"
expect text-layers-past-depth-refused 1 "model.text_layers = 3: the model has 2 decoder layers" \
  mpiexec -n 1 $q train "${cut[@]}" model.text_layers=3 run.out_dir="$tmp/cut3"
expect vision-layers-drop-deepstack-refused 1 "model.vision_layers = 2: drops the DeepStack tap at ViT block 2" \
  mpiexec -n 1 $q train "${cut[@]}" model.preset=demo model.vision_layers=2 run.out_dir="$tmp/cutv"

# model.rope_theta: the text rotary's base in place of the preset's, in the checkpoint's config (which the exports and
# generate read); a negative one is refused by name.
if mpiexec -n 1 $q train "${cut[@]}" model.rope_theta=7 run.out_dir="$tmp/rope" >$tmp/rope.log 2>&1; then
  ck=$(ls $tmp/rope/checkpoints/step_*.h5 | tail -1)
  [[ $(h5dump "$ck" 2>/dev/null | grep -o 'rope_theta[^,]*') == *'": 7.0'* ]] &&
    pass "model.rope_theta: the checkpoint's config carries the new base" ||
    bad "model.rope_theta: $(h5dump "$ck" 2>/dev/null | grep -o 'rope_theta[^,]*' | head -2)"
else
  bad "model.rope_theta: train failed: $(tail -3 $tmp/rope.log)"
fi
expect rope-theta-negative 1 "model.rope_theta" mpiexec -n 1 $q train "${cut[@]}" model.rope_theta=-1 run.out_dir="$tmp/rope2"

finish
