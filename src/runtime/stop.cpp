#include "q3vl/runtime/stop.hpp"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <filesystem>

namespace q3vl {

namespace {

using clock = std::chrono::steady_clock;

// Set from the signal handler, so only a sig_atomic_t store happens there.
volatile sig_atomic_t g_signal = 0;

struct State {
  double walltime = 0;
  std::string out_dir;
  clock::time_point start = clock::now();
  double max_step = 0, max_ckpt = 0;
  StopReason reason = StopReason::None;
} g;

// Handlers that were there before ours (MPICH takes SIGUSR1 for its process-failure notices): still
// called, so that we only add to them.
struct sigaction g_prev_usr1 {}, g_prev_term {};

void on_signal(int sig) {
  if (sig == SIGTERM && g_signal == SIGTERM) {  // asked twice: end now, without the checkpoint
    signal(SIGTERM, SIG_DFL);
    raise(SIGTERM);
    return;
  }
  g_signal = sig;
  const struct sigaction& prev = sig == SIGUSR1 ? g_prev_usr1 : g_prev_term;
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && !(prev.sa_flags & SA_SIGINFO))
    prev.sa_handler(sig);
}

void install(int sig, struct sigaction* prev) {
  struct sigaction sa {}, old {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a signal must not turn a read or write into an EINTR error
  sigaction(sig, &sa, &old);
  if (old.sa_handler != on_signal) *prev = old;  // stop_init may run more than once
}

// Trigger slots in the all-reduce, in priority order: a STOP file (the user wants the run to end)
// wins over signal and walltime (the run wants to continue in a requeued job).
enum Slot { kStopFile, kSignal, kWalltime, kSignalNumber, kSlots };

}  // namespace

void stop_init(double walltime_s, const std::string& out_dir) {
  g = State{};
  g.walltime = walltime_s;
  g.out_dir = out_dir;
  g_signal = 0;
  install(SIGUSR1, &g_prev_usr1);
  install(SIGTERM, &g_prev_term);
}

void stop_note_step(double seconds) { g.max_step = std::max(g.max_step, seconds); }
void stop_note_checkpoint(double seconds) { g.max_ckpt = std::max(g.max_ckpt, seconds); }

bool should_stop(Comm& world, std::string* why) {
  // Per slot, the lowest rank that has the trigger (INT_MAX: none), and minus the highest signal
  // number, so that one all-reduce (min) gives every rank the same answer.
  int32_t first[kSlots] = {INT_MAX, INT_MAX, INT_MAX, 0};
  const int me = world.rank();
  const int sig = g_signal;
  if (sig) first[kSignal] = me, first[kSignalNumber] = -sig;
  double elapsed = std::chrono::duration<double>(clock::now() - g.start).count();
  // Room for one more step, the final checkpoint, and 5% of the budget for what is not measured.
  if (g.walltime > 0 && elapsed + g.max_step + g.max_ckpt + 0.05 * g.walltime > g.walltime) first[kWalltime] = me;
  std::filesystem::path stop_file = std::filesystem::path(g.out_dir) / "STOP";
  std::error_code ec;
  if (me == 0 && !g.out_dir.empty() && std::filesystem::exists(stop_file, ec)) first[kStopFile] = 0;
  int32_t all[kSlots];
  std::copy(first, first + kSlots, all);
  world.all_reduce(all, kSlots, DType::I32, ReduceOp::Min);

  g.reason = all[kStopFile] != INT_MAX  ? StopReason::StopFile
             : all[kSignal] != INT_MAX  ? StopReason::Signal
             : all[kWalltime] != INT_MAX ? StopReason::Walltime
                                         : StopReason::None;
  if (g.reason == StopReason::None) return false;
  if (g.reason == StopReason::StopFile && me == 0) {
    std::filesystem::rename(stop_file, std::filesystem::path(g.out_dir) / "STOP.done", ec);
  }
  if (why) {
    char buf[256];
    switch (g.reason) {
      case StopReason::StopFile:
        std::snprintf(buf, sizeof buf, "%s found (renamed STOP.done)", stop_file.c_str());
        break;
      case StopReason::Signal:
        std::snprintf(buf, sizeof buf, "%s received (rank %d)", -all[kSignalNumber] == SIGTERM ? "SIGTERM" : "SIGUSR1",
                      all[kSignal]);
        break;
      default:
        std::snprintf(buf, sizeof buf,
                      "runtime.walltime = %.0f s nearly spent (%.0f s elapsed; next step %.1f s + checkpoint %.1f s "
                      "+ 5%% margin would not fit; rank %d)",
                      g.walltime, elapsed, g.max_step, g.max_ckpt, all[kWalltime]);
    }
    *why = buf;
  }
  return true;
}

StopReason stop_reason() { return g.reason; }

int stop_exit_status() { return g.reason == StopReason::None ? 0 : kExitRequeue; }

int stop_signal_pending() { return g_signal; }

}  // namespace q3vl
