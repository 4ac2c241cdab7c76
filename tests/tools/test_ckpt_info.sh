#!/usr/bin/env bash
# tools/ckpt_info on a checkpoint written in the documented layout (tests/tools/make_checkpoint.py) and on
# a real one from a short `q3vl train` run; --check finds every planted corruption.
source "$(dirname "$0")/../lib.sh"
ci=tools/ckpt_info
g=tests/data/golden/moe/model

ck=$($py tests/tools/make_checkpoint.py $g $tmp/ck 7 --freeze-vision) || bad "make_checkpoint"
out=$($ci $tmp/ck 2>&1) || bad "ckpt_info ran: $out"
grep -q "^step *7$" <<<"$out" && grep -q "^world_size *4$" <<<"$out" && grep -q "^model *hf .*golden/moe/model$" <<<"$out" &&
  grep -q "^trains *tune_merger, tune_llm$" <<<"$out" && pass "header: step, world size, model, trained parts" ||
  bad "header: $out"
n=$($py -c "import h5py,sys; f=h5py.File(sys.argv[1]); l=[]; f.visititems(lambda n,o: l.append(n) if isinstance(o,h5py.Dataset) else None); print(len(l))" $ck)
[[ $(grep -c '^model/\|^optim/' <<<"$out") == "$n" ]] && pass "all $n tensors listed" || bad "listed $(grep -c '^model/\|^optim/' <<<"$out") of $n"
want=$($py -c "import h5py,numpy as np,sys; a=h5py.File(sys.argv[1])['model/model.language_model.layers.0.mlp.experts.down_proj'][()]; print(f'{np.linalg.norm(a.astype(np.float64)):.6g}')" $ck)
grep -qE "^model/model.language_model.layers.0.mlp.experts.down_proj +4x64x32 +float32 +norm $want$" <<<"$out" &&
  pass "shape, dtype and norm ($want)" || bad "down_proj line (norm $want): $(grep experts.down_proj <<<"$out" | head -1)"
! grep -q "optim/exp_avg/model.visual.blocks" <<<"$out" && grep -q "optim/exp_avg/model.visual.merger" <<<"$out" &&
  pass "frozen vision has no optimizer state" || bad "optimizer state of the frozen vision tower"
out=$($ci --check $tmp/ck 2>&1) && grep -q "OK (.* checksums match" <<<"$out" && pass "--check: intact checkpoint" ||
  bad "--check of an intact checkpoint: $out"
grep -q '^tune_vision = false$' <<<"$($ci --deck $ck)" && pass "--deck prints the deck" || bad "--deck"
grep -q "^config *Qwen3VLMoeForConditionalGeneration, 2 layers, hidden 64 " <<<"$out" &&
  $ci --config $ck | sed -n '/^{/,$p' | cmp -s - $g/config.json && pass "config line; --config prints config.json" ||
  bad "config: $(grep ^config <<<"$out")"

# Planted corruptions, each on its own copy.
copy() { mkdir -p $tmp/$1 && cp $ck $tmp/$1/step_00000007.h5 && echo $tmp/$1/step_00000007.h5; }
edit() { $py -c "import h5py,numpy as np,sys; f=h5py.File(sys.argv[1],'r+'); $2" "$1"; }
T=model.language_model.layers.1.self_attn.o_proj.weight
c=$(copy bytes)  # overwrite 16 bytes in the middle of a dataset's data with finite floats
off=$($py -c "import h5py,sys; d=h5py.File(sys.argv[1])['model/$T']; print(d.id.get_offset() + d.id.get_storage_size() // 2)" $c)
printf '\x00\x00\x80\x3f\x00\x00\x80\x3f\x00\x00\x80\x3f\x00\x00\x80\x3f' | dd of=$c bs=1 seek=$off conv=notrunc status=none
expect "overwritten bytes" 1 "model/$T: data does not match its checksum" $ci --check $c
c=$(copy nan)  # a NaN with a matching checksum: found as a NaN
edit "$c" "import sys; sys.path.insert(0,'tools'); from q3vl_tools import ckpt; d=f['optim/exp_avg/$T']; a=d[()]; a[3,5]=np.nan; d[...]=a; d.attrs['checksum']=np.uint64(ckpt.checksum(a.ravel()))"
out=$($ci --check $c 2>&1); rc=$?
[[ $rc == 1 ]] && grep -q "optim/exp_avg/$T: 1 NaN and 0 Inf values" <<<"$out" && ! grep -q checksum <<<"$out" &&
  pass "planted NaN" || bad "planted NaN: rc=$rc: $out"
c=$(copy inf) && edit "$c" "d=f['model/$T']; a=d[()]; a[0,0]=np.inf; d[...]=a"
expect "planted Inf" 1 "model/$T: 0 NaN and 1 Inf values" $ci --check $c
c=$(copy trunc) && truncate -s $(($(stat -c %s $c) * 2 / 3)) $c
expect "truncated file" 1 "BAD|truncated" $ci --check $c
c=$(copy moment) && edit "$c" "del f['optim/exp_avg_sq/$T']"
expect "missing moment" 1 "model/$T: optimizer moment optim/exp_avg_sq/$T is missing" $ci --check $c
c=$(copy frozen) && edit "$c" "f['optim/exp_avg/model.visual.blocks.0.norm1.weight'] = np.zeros(32, 'f4')"
expect "state for a frozen tensor" 1 "optim/exp_avg/model.visual.blocks.0.norm1.weight: optimizer state for a tensor the deck freezes" $ci --check $c
c=$(copy format) && edit "$c" "f.attrs['format'] = 'something'"
expect "format attribute" 1 "not a q3vl checkpoint" $ci --check $c
c=$(copy attr) && edit "$c" "del f.attrs['world_size']"
expect "missing attribute" 1 "root attribute 'world_size' is missing" $ci --check $c
c=$(copy name) && mv $c $tmp/name/step_00000008.h5
expect "step differs from the name" 1 "file name says step 8, its step attribute 7" $ci --check $tmp/name/step_00000008.h5
c=$(copy config) && edit "$c" "f.attrs['hf_config_json'] = '{\"architectures\": ['"
expect "config not JSON" 1 "hf_config_json is not valid JSON" $ci --check $c
c=$(copy older) && edit "$c" "del f.attrs['hf_config_json']"  # written before checkpoints kept it: fine
out=$($ci --check $c 2>&1) && grep -q "^config *not stored" <<<"$out" && pass "older checkpoint without config.json: OK" ||
  bad "older checkpoint: $out"
echo "not hdf5" >$tmp/text.h5
expect "not HDF5" 1 "not an HDF5 file" $ci $tmp/text.h5
expect "missing file" 1 "no such file" $ci $tmp/none.h5
expect "directory without latest" 1 "without a 'latest'" $ci $tmp

# A real checkpoint from a short training run (the checksums are checkpoint.cpp's).
if needs "real training run" bin/q3vl mpiexec; then
  if mpiexec -n 2 bin/q3vl train model.hf=$g train.steps=2 run.out_dir=$tmp/run data.seq_len=64 train.global_batch=2 \
      train.synthetic_samples=8 >$tmp/train.log 2>&1; then
    out=$($ci --check $tmp/run/checkpoints 2>&1) && grep -q "step_00000002.h5: OK" <<<"$out" && grep -q "^world_size *2$" <<<"$out" &&
      pass "real checkpoint: --check OK" || bad "real checkpoint: $out"
    $ci --config $tmp/run/checkpoints | sed -n '/^{/,$p' | cmp -s - $g/config.json &&
      pass "real checkpoint: model.hf's config.json stored unchanged" || bad "real checkpoint: stored config.json differs"
  else bad "q3vl train: $(tail -5 $tmp/train.log)"; fi
fi

finish
