#!/usr/bin/env bash
# Stops the test Slurm started by start.sh (by the pid files it wrote) and removes its state.
set -uo pipefail
dir=${Q3VL_SLURM_DIR:-/tmp/q3vl-slurm}
[[ -d $dir ]] || exit 0
if [[ -f $dir/slurm.conf ]]; then  # jobs first, so no step outlives its slurmd
  SLURM_CONF=$dir/slurm.conf scancel --quiet --user="$(id -un)" 2>/dev/null
fi
for f in slurmd.pid slurmctld.pid munge/munged.pid; do
  [[ -f $dir/$f ]] || continue
  pid=$(<"$dir/$f")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
done
rm -rf "$dir"
echo "slurm stopped"
