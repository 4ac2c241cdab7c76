#!/usr/bin/env bash
# call 2 (twenty-second session): the NCCL paths written without a GPU in the twenty-first session: mpi_tests' DevTp
# suites at 2 and 4 ranks sharing the GPU (serve.ep's expert sets, decode graphs holding the NCCL sums), then tiny
# servers over NCCL (serve.ep = 2, Q3VL_TP_GRAPHS=1) against generate on the CPU: tools/gpu/serve_checks.sh part nccl.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1
rm -rf /tmp/results /tmp/sc_nccl
MPI_TESTS=/tmp/rt/bin/mpi_tests timeout 540 bash tools/gpu/serve_checks.sh /tmp/rt/bin/q3vl /tmp/rt/bin/unit_tests /tmp/sc_nccl nccl
echo "rc=$? $((SECONDS-T0)) s" >> /tmp/results/summary.txt
tar czf $OUT/results.tgz -C /tmp/results . ; cp /tmp/results/summary.txt $OUT/
cut -c1-250 /tmp/results/summary.txt
