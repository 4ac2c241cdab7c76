#!/usr/bin/env bash
# An H200 (over 100 GiB) runs call2.sh (the 30B-A3B cut's 6 layers need its memory), an H100 call2h.sh.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if (( mib > 100000 )); then exec bash docs/perf/2026-12-06-twentyeighth/call2/call2.sh
else exec bash docs/perf/2026-12-06-twentyeighth/call2h/call2h.sh; fi
