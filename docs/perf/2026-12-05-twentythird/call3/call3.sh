#!/usr/bin/env bash
# call 3 (twenty-third session): call 2's 8B server at serve.tp = 2 over NCCL (2 ranks sharing the GPU) with decode
# steps as graphs holding the NCCL sums (Q3VL_TP_GRAPHS=1) came up but answered nothing in 60 s at 0-13% GPU use.
# Again with runtime.timeout = 40 (the watchdog names what it waits for) and NCCL_DEBUG=WARN, then without graphs.
set -u
T0=$SECONDS
tar xJf devpack/rt.tar.xz -C /tmp && source /tmp/rt/env.sh
tar xJf devpack/tok.tar.xz
export NCCL_NVLS_ENABLE=0 OPENBLAS_NUM_THREADS=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=WARN
out=/tmp/res3; rm -rf $out; mkdir -p $out
pack() { tar czf $OUT/results.tgz -C $out . ; cp $out/summary.txt $OUT/ 2>/dev/null; }
say() { echo "$*" >> $out/summary.txt; }
nvidia-smi -L > $out/summary.txt
hostid=/tmp/nccl_hostid
printf '#!/bin/sh\n[ "$(nvidia-smi -L | wc -l)" -lt "${PMI_SIZE:-1}" ] && export NCCL_HOSTID=q3vl-rank-$PMI_RANK\nexec "$@"\n' \
  >$hostid && chmod +x $hostid
python3 - <<'PY'
import struct, zlib
w = h = 448
raw = b"".join(b"\0" + bytes([(x * 7 + y * 3) % 256 for x in range(w) for _ in range(3)]) for y in range(h))
def chunk(t, d): return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
open("/tmp/pic.png", "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                                 + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
PY
one() {  # NAME [env...]
  local n=$1 t1=$SECONDS port=""; shift
  env "$@" timeout 150 mpiexec -n 2 $hostid /tmp/rt/bin/q3vl serve model.preset=8B model.backend=cuda model.dtype=bf16 \
    serve.port=0 serve.max_context=8192 serve.max_batch=64 serve.step_tokens=2048 run.timing=false serve.tp_comm=nccl \
    runtime.timeout=40 > $out/serve_$n.log 2>&1 &
  local pid=$!
  for _ in $(seq 600); do
    port=$(grep -oP 'on http://127\.0\.0\.1:\K[0-9]+' $out/serve_$n.log); [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break; sleep 0.2
  done
  say "$n: up after $((SECONDS - t1)) s (port ${port:-none})"
  if [[ -n $port ]]; then
    timeout 90 python3 tools/bench_serve --port $port -n 4 -c 1 --prompt-words 200 --image /tmp/pic.png --max-tokens 128 \
      --label "$n c=1" --timeout 60 > $out/bench_$n.txt 2>&1
    say "$n: bench rc=$? $(tail -1 $out/bench_$n.txt | cut -c1-200)"
    kill -TERM $pid 2>/dev/null
  fi
  wait $pid; say "$n: server rc=$? after $((SECONDS - t1)) s"
  grep -E "engine over|error|timeout|watchdog|NCCL WARN|waited" $out/serve_$n.log | head -12 >> $out/summary.txt
  pkill -9 -f "rt/bin/q3vl" 2>/dev/null; sleep 2; pack
}
one tp2g Q3VL_TP_GRAPHS=1
one tp2
say "done $((SECONDS - T0)) s"; pack
cat $out/summary.txt | cut -c1-250
