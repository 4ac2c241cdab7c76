#!/usr/bin/env bash
# The chain_bench runs of the twenty-ninth session (one H100, warm, 11:04-11:06 UTC), binary of tools/gpu/chain_bench.cu
# packed alone (pack-runtime devpack_chain bin/chain_bench, carried as devpack_chain):
tar xJf devpack_chain/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
/tmp/rt/bin/chain_bench 16 50 | tee $OUT/chain16.txt
for e in "Q3VL_GEMV_TMA=1" "Q3VL_GEMV_TMA=0" "Q3VL_PDL=0"; do
  echo "## $e"; env $e /tmp/rt/bin/chain_bench 16 50 | grep -E "^\| (none|qkv@gu) "
done | tee $OUT/chain16_env.txt
