# Sourced by the job scripts in jobs/ (from the repository root, where they cd first).
#
# Launch: `srun --mpi=pmi2`. Debian's MPICH (4.0, Hydra's PMI client) speaks PMI-2 to Slurm's mpi/pmi2
# plugin, so srun starts the ranks itself: one task per GPU (or CPU core group), Slurm's signals reach
# every rank directly, and srun's exit status is the highest of the ranks'. (`mpiexec -n $SLURM_NTASKS`
# inside the allocation works too, Hydra launching through srun, but then Slurm signals Hydra's proxies.)
#
# Stopping early: `--signal=USR1@N` (without B:) makes Slurm send SIGUSR1 to every rank N seconds
# before the time limit; scancel and preemption send SIGTERM. q3vl then finishes the step, writes a
# checkpoint and exits with status 3 (see include/q3vl/runtime/stop.hpp); q3vl_step turns that into
# `scontrol requeue`, and the requeued job resumes from the checkpoint (train.resume = auto).
# Slurm holds a requeued job for its credential lifetime (AuthInfo cred_expire + 1 s, 121 s by default)
# before starting it again: do not cut that short (scontrol update StartTime=now, scontrol release). Step
# ids restart at 0 in the requeued job, so its step N reuses the mpi/pmi2 socket name of the old run's step
# N, whose slurmstepd may still be exiting on that node; when it does, it removes the new step's socket and
# srun kills the step at its next PMI fence, MPI_Finalize's at the latest ("mpi/pmi2: failed to send temp
# kvs", exit 137).

set -uo pipefail

# SIGUSR1 is for the ranks; the batch shell would die of it if Slurm ever sent it here.
trap 'echo "job $SLURM_JOB_ID: batch shell got SIGUSR1 (ignored; the ranks stop themselves)"' USR1

echo "job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}:" \
  "${SLURM_NTASKS:-?} task(s), $(date -Is), in $(pwd)"

# Seconds left before the job's time limit, for runtime.walltime (squeue's %L: [D-][HH:]MM:SS; 0 when
# unlimited), so that q3vl stops with a checkpoint even if the warning signal is lost.
time_left_s() {
  local l d=0 t=0 f
  l=$(squeue -h -j "$SLURM_JOB_ID" -o %L)
  [[ $l =~ ^[0-9:-]+$ ]] || { echo 0; return; }
  [[ $l == *-* ]] && d=${l%%-*} && l=${l#*-}
  for f in ${l//:/ }; do t=$((t * 60 + 10#$f)); done
  echo $((d * 86400 + t))
}

# q3vl_step MODE [DECK] [key=value ...]: one q3vl run over all tasks of the job.
# Returns 0 on success; requeues the job on exit status 3; exits the job with any other failure.
q3vl_step() {
  srun --mpi=pmi2 --kill-on-bad-exit=1 bin/q3vl "$@"
  local rc=$?
  case $rc in
    0) return 0 ;;
    3) echo "job $SLURM_JOB_ID: q3vl $1 stopped early with a checkpoint (exit 3): requeueing"
       scontrol requeue "$SLURM_JOB_ID"
       exit 0 ;;
    *) echo "job $SLURM_JOB_ID: q3vl $1 failed (exit $rc)" >&2
       exit "$rc" ;;
  esac
}
