// Stopping a run early and cleanly, before the scheduler kills it. Three triggers:
//  - a signal: SIGUSR1 (Slurm's --signal=USR1@N warning before the time limit) or SIGTERM (scancel,
//    preemption; Slurm sends SIGKILL KillWait seconds later);
//  - the wall-clock budget runtime.walltime: stop when the next step and a checkpoint would not fit;
//  - a file named STOP in run.out_dir (rank 0 looks; it is renamed STOP.done so the next run goes on).
// All three write a checkpoint and exit with status 3. A second SIGTERM ends the process at once (the default
// action), and a pending SIGTERM shortens collective waits (Comm::kTermGrace): a job whose ranks cannot meet
// any more still ends when it is cancelled.
// Every rank calls should_stop() at the same step boundary; one all-reduce makes them all agree, so a
// signal delivered to one rank stops all of them at the same step.
//
// How a training loop uses it:
//   stop_init(deck.real("runtime.walltime"), deck.str("run.out_dir"));   // once, before the loop
//   for (...) {
//     ... one optimizer step ...;  stop_note_step(seconds of that step);
//     if (checkpoint due) { ... write ...; stop_note_checkpoint(seconds of the write); }
//     std::string why;
//     if (should_stop(world, &why)) {
//       log_info("stopping early: " + why);
//       ... write a checkpoint unless this step just wrote one ...;
//       return stop_exit_status();   // the mode's return value is q3vl's exit status
//     }
//   }
#pragma once
#include <string>

#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// Exit status for "stopped early, checkpoint written" (signal, walltime or STOP file). The job scripts in
// jobs/ turn it into `scontrol requeue`; the requeued job resumes (the STOP file was renamed STOP.done).
constexpr int kExitRequeue = 3;

enum class StopReason { None, Signal, Walltime, StopFile };

// Installs the SIGUSR1/SIGTERM handlers, starts the wall clock, forgets earlier triggers.
// walltime_s <= 0: no budget.
void stop_init(double walltime_s, const std::string& out_dir);

// Durations the walltime budget needs: the longest step and the longest checkpoint write so far.
void stop_note_step(double seconds);
void stop_note_checkpoint(double seconds);

// Collective over `world`: true on every rank when any rank has a trigger. `why` names the trigger
// and the lowest rank that saw it.
bool should_stop(Comm& world, std::string* why = nullptr);

// After should_stop() returned true: the reason (the same on every rank) and the exit status for it.
StopReason stop_reason();
int stop_exit_status();

// The stop signal this process received since stop_init (SIGUSR1, SIGTERM), or 0. Any thread.
int stop_signal_pending();

}  // namespace q3vl
