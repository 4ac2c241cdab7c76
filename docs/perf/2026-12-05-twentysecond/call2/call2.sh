#!/usr/bin/env bash
# call 2 (twenty-second session): (1) the NCCL paths written without a GPU in the twenty-first session: mpi_tests'
# DevTp suites at 2 and 4 ranks sharing the GPU (serve.ep's expert sets, decode graphs holding the NCCL sums), then
# tiny servers over NCCL (serve.ep = 2, Q3VL_TP_GRAPHS=1) against generate on the CPU: serve_checks.sh part nccl.
# (2) One stream's decode with o_proj's weights prefetched into L2 during attention (Q3VL_L2_PREFETCH_MB=64) against
# without, the 8B in fp8 and the 30B-A3B in bf16, each pair back to back: serve_checks.sh parts 8bfp8 and 30b at CONC=1.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
out=/tmp/res2; rm -rf $out /tmp/sc_*; mkdir -p $out
pack() { tar czf $OUT/results.tgz -C $out . ; cp $out/summary.txt $OUT/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
run() {  # NAME PART CONC TIMEOUT [env...]
  local n=$1 p=$2 c=$3 t=$4; shift 4
  rm -rf /tmp/results
  env CONC="$c" MPI_TESTS=/tmp/rt/bin/mpi_tests "$@" timeout $t bash tools/gpu/serve_checks.sh /tmp/rt/bin/q3vl \
    /tmp/rt/bin/unit_tests /tmp/sc_$n "$p"
  mkdir -p $out/$n; tar xzf /tmp/sc_$n/results.tgz -C $out/$n 2>/dev/null; grep -v "^ " /tmp/sc_$n/summary.txt | grep -v "^GPU\|^node" >> $out/summary.txt
  say "$n done $((SECONDS-T0)) s"; pack
}
run nccl nccl 1 200
run 8bfp8_pf 8bfp8 1 70 Q3VL_L2_PREFETCH_MB=64
run 8bfp8 8bfp8 1 70
run 30b_pf 30b 1 90 Q3VL_L2_PREFETCH_MB=64
run 30b 30b 1 90
say "done $((SECONDS-T0)) s"; pack
grep -E "mpi_tests|nccl|graphs|ep2|c=1 |engine over|done" $out/summary.txt | cut -c1-230
