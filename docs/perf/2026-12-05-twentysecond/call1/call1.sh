#!/usr/bin/env bash
# call 1 (twenty-second session; device starts were scarce, so one call carries what matters most, each step started
# only while the call has room for it):
# 1. the op table's grouped cases and the MoE model suites with grouped_ws's two new forms on: FWD/DX's second consumer
#    issuing no wgmma on an expert's last M tile of <= 64 rows (Q3VL_WS_SKIP=1) and DW written from registers
#    (Q3VL_DW_REGS=1); with the L2 prefetch of step 4 on, DevInfer's decode steps on the golden models too;
# 2. mpi_tests' DevTp suites at 2 ranks sharing the GPU: serve.ep's expert sets and decode graphs holding the NCCL sums;
# 3. moe_bench with each form and without;
# 4. one stream of the 8B in fp8 with o_proj's weights prefetched into L2 during attention (Q3VL_L2_PREFETCH_MB=64)
#    and without, back to back (serve_checks.sh part 8bfp8, CONC=1);
# 5. the 30B-A3B cut with both grouped forms on, beside transformers (an H200 only: it needs ~103 GiB).
source tools/gpu/call_lib.sh res1
left() { (( 500 - (SECONDS - T0) > $1 )); }
Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1 Q3VL_L2_PREFETCH_MB=64 Q3VL_OPS=grouped,moe unit_gpu 'BackendOps.Fp32:BackendOps.Bf16:BackendOps.Fp16:DevModel.*:DevLayers.*:DevInfer.*' 180
export NCCL_SOCKET_IFNAME=lo  # as serve_checks.sh's part nccl runs them
t1=$SECONDS; Q3VL_REQUIRE_GPU=1 timeout 90 mpiexec -n 2 /tmp/rt/bin/mpi_tests --gtest_filter='*DevTp*' > $out/mpi_devtp.log 2>&1
say "mpi_tests DevTp np2 rc=$? $((SECONDS-t1)) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' $out/mpi_devtp.log | sort -u | tr '\n' ' ')"
grep -E "dev tp|FAILED  \]|Failure" $out/mpi_devtp.log | sort -u | head -12 >> $out/summary.txt; pack
mb() {  # NAME ENV...
  local n=$1 t1=$SECONDS; shift
  env "$@" timeout 60 /tmp/rt/bin/moe_bench > $out/moe_bench_$n.txt 2>&1
  say "moe_bench $n ($*) rc=$? $((SECONDS-t1)) s"; pack
}
mb new Q3VL_WS_SKIP=1
mb regs Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1
mb old Q3VL_WS_SKIP=0
sc() {  # NAME PART TIMEOUT [env...]: serve_checks.sh at one stream
  local n=$1 p=$2 t=$3; shift 3
  rm -rf /tmp/results
  env CONC=1 "$@" timeout $t bash tools/gpu/serve_checks.sh $q /tmp/rt/bin/unit_tests /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null
  grep -E "c=1 |engine over|up after" /tmp/sc_$n/summary.txt | sed "s/^/$n: /" >> $out/summary.txt; pack
}
left 150 && sc fp8_pf 8bfp8 70 Q3VL_L2_PREFETCH_MB=64
left 80 && sc fp8 8bfp8 70
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
((mib < 110000)) && say "q30b skipped: the cut needs ~103 GiB, this GPU has $mib MiB"
if ((mib >= 110000)) && left 150; then
  Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1 train_prof q30b input/bench_30b_a3b_gpu.deck 100 run.profile_top=0
  left 40 && hf_train hf30b 60 --preset 30B-A3B --text-layers 6 --batch 1 --seq 4096
  ratio q30b hf30b "30B-A3B x 6 layers, 1 x 4096 tokens (Q3VL_WS_SKIP=1 Q3VL_DW_REGS=1)"
fi
say "done $((SECONDS-T0)) s"; pack
cut -c1-300 $out/summary.txt; for n in new regs old; do grep -E "^\| (gate_up|down)" $out/moe_bench_$n.txt | cut -d'|' -f2-4,6 | tr '\n' ';'; echo; done
grep -E "grouped|left out|within" $out/unit.log | grep -v " ok$" | head
