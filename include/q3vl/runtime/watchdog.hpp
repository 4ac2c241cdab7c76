// The watchdog's liveness half (the other half is Comm::wait's deadline on every collective it polls).
//
// Calls that block inside MPI without polling -- the collective HDF5 reads and writes of checkpoints, the raw MPI
// calls around them -- cannot be timed out from the calling thread. So each rank runs a thread that publishes a
// heartbeat (the node's monotonic clock) in a shared-memory window among the ranks of its node. While the main
// thread is inside a Blocking region, that thread checks the other ranks' heartbeats: a rank silent for longer
// than runtime.timeout (SIGSTOPped, or dead) ends the job with MPI_Abort, naming the region, the step and the
// rank (once SIGTERM came, after Comm::kTermGrace at most). A slow but live rank (a large checkpoint on a slow
// disk) keeps its heartbeat and is waited for.
// Comm::wait uses the heartbeats to name silent ranks in its own message. Ranks on other nodes are not visible
// from here: their node-mates' watchdogs name them.
#pragma once
#include <mpi.h>

#include <string>

namespace q3vl {

// Collective over `world` (Runtime::init): the shared heartbeat window, and the thread. timeout <= 0: the thread
// only beats. Safe to call once; watchdog_set_timeout changes the limit later (after the deck is read).
void watchdog_start(MPI_Comm world, double timeout);
void watchdog_set_timeout(double timeout);
// Stops and joins the thread (before MPI_Finalize; the window goes with MPI).
void watchdog_stop();

// A heartbeat this old names a rank as silent in Comm::wait's message (the thread beats every 0.2 s).
constexpr double kSilentSeconds = 2;

// The ranks of the world on this node whose heartbeat is older than `seconds`: "rank 2 for 12.3 s",
// "ranks 2 (12.3 s), 3 (12.1 s)"; "" when none (or the watchdog is not running).
std::string watchdog_silent(double seconds);

// While one lives, the main thread is in a call that cannot be interrupted: a silent rank ends the job.
class Blocking {
 public:
  explicit Blocking(const std::string& what);
  ~Blocking();
  Blocking(const Blocking&) = delete;
  Blocking& operator=(const Blocking&) = delete;
};

}  // namespace q3vl
