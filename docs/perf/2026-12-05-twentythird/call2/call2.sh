#!/usr/bin/env bash
# call 2 (twenty-third session, an H100 or H200): (1) serve_checks.sh part nccl: mpi_tests' DevTp suites at 2 and 4
# ranks sharing the GPU, then tiny servers over NCCL (serve.ep = 2, Q3VL_TP_GRAPHS=1) against generate on the CPU;
# (2) one 8B fp8 stream with o_proj's weights prefetched into L2 during attention (Q3VL_L2_PREFETCH_MB=64) and without,
# back to back; (3) the 8B bf16 at serve.tp = 2 over NCCL (2 ranks sharing the GPU), decode steps op by op against
# graphs holding the NCCL sums (Q3VL_TP_GRAPHS=1), one stream each. Each step only while the call has room.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
out=/tmp/res2; rm -rf $out /tmp/sc_*; mkdir -p $out
pack() { tar czf $OUT/results.tgz -C $out . ; cp $out/summary.txt $OUT/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
left() { (( 540 - (SECONDS - T0) > $1 )); }
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
left 150 && run 8bfp8_pf 8bfp8 1 75 Q3VL_L2_PREFETCH_MB=64
left 80 && run 8bfp8 8bfp8 1 75
left 100 && run 8btp2g 8btp2g 1 95
left 140 && run 8btp2 8btp2 1 150
say "done $((SECONDS-T0)) s"; pack
grep -E "mpi_tests|nccl|graphs|ep2|c=1 |engine over|done|FAIL" $out/summary.txt | cut -c1-230
