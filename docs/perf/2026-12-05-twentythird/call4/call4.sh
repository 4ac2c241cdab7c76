#!/usr/bin/env bash
# call 4 (twenty-third session): the head after the knobs' deletion (9cafc79): (1) the GPU suites: the op table with
# the grouped and MoE cases, the device model, its layers, inference and the goldens on CUDA; (2) mpi_tests' DevTp at
# 2 ranks sharing the GPU (the fp32 bounds now relative to the largest logit); (3) moe_bench with every mode's DRAM
# floor; (4) on an H200 only (~103 GiB), the 30B-A3B cut beside transformers.
source tools/gpu/call_lib.sh res4
left() { (( 430 - (SECONDS - T0) > $1 )); }
Q3VL_OPS=grouped,moe unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:BackendOps.Fp16:DevModel.*:DevLayers.*:DevInfer.*:Golden.*' 200
export NCCL_SOCKET_IFNAME=lo
t1=$SECONDS; Q3VL_REQUIRE_GPU=1 timeout 60 mpiexec -n 2 /tmp/rt/bin/mpi_tests --gtest_filter='*DevTp*' > $out/mpi_devtp.log 2>&1
say "mpi_tests DevTp np2 rc=$? $((SECONDS-t1)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/mpi_devtp.log | sort -u | tr '\n' ' ')"; pack
t1=$SECONDS; timeout 60 /tmp/rt/bin/moe_bench > $out/moe_bench.txt 2>&1; say "moe_bench rc=$? $((SECONDS-t1)) s"; pack
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
((mib < 110000)) && say "q30b skipped: the cut needs ~103 GiB, this GPU has $mib MiB"
if ((mib >= 110000)) && left 200; then
  train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
  left 60 && hf_train hf30b 100 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens"
fi
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt; cat $out/moe_bench.txt | head -14
grep -E "grouped|left out|within" $out/unit.log | grep -v " ok$" | head
