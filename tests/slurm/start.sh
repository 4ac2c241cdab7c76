#!/usr/bin/env bash
# Starts a one-node Slurm on this machine for the Slurm tests: munged, slurmctld and slurmd from
# Debian's packages (make deps installs them), run as root, all state under $Q3VL_SLURM_DIR.
# Idempotent: a cluster left from an earlier run is stopped first. Clients find it through SLURM_CONF:
#   source "${Q3VL_SLURM_DIR:-/tmp/q3vl-slurm}/env"
# The node declares 4 CPUs whatever the machine has (config_overrides), so 4-task jobs run on 2 cores.
# A requeued job is held for cred_expire + 1 s before it starts again: 21 s here (Slurm's default 121 s),
# with a scheduling pass every 2 s (not 60), so that the requeue test stays short. Never cut the hold
# shorter (jobs/common.sh says why).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${Q3VL_SLURM_DIR:-/tmp/q3vl-slurm}
cpus=${Q3VL_SLURM_CPUS:-4}

for b in munged slurmctld slurmd sinfo; do
  command -v "$b" >/dev/null || { echo "start.sh: $b not found; run 'make deps' (slurm-wlm, munge)" >&2; exit 1; }
done
bash "$here/stop.sh" >/dev/null 2>&1 || true
mkdir -p "$dir"/{munge,state,spool,log}
chmod 700 "$dir/munge"

# munge: a fresh key; munged insists on private directories and refuses root without --force.
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
  2>>"$dir/log/munged.log"

node=$(hostname -s)
cat >"$dir/slurm.conf" <<CONF
# Written by tests/slurm/start.sh: one node, root daemons, no cgroups, no accounting.
ClusterName=q3vltest
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=20
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${Q3VL_SLURM_PORT:-6817}
SlurmdPort=$(( ${Q3VL_SLURM_PORT:-6817} + 1 ))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env"
export SLURM_CONF=$dir/slurm.conf

slurmctld -i -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N "$node"

# Wait until the node is idle (slurmd registered and the controller accepted it).
for _ in $(seq 60); do
  state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
  if [[ $state == idle ]]; then
    echo "slurm up: node $node idle, $cpus CPUs; source $dir/env"
    exit 0
  fi
  sleep 1
done
echo "start.sh: node $node not idle after 60 s (state '${state:-none}'); logs in $dir/log:" >&2
tail -n 20 "$dir"/log/*.log >&2
exit 1
