// The MPI process: init/finalize, where this rank runs (host, node, local rank, GPU), the world
// communicator, the resolved deck on every rank, and how errors end the run.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/runtime/comm.hpp"

namespace q3vl {

struct Placement {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;  // among the ranks on this node (MPI_Comm_split_type shared memory)
  int node = 0, nodes = 1;             // node index in [0, nodes)
  std::string host;
  int gpu = -1;                        // device used by this rank (local_rank mod visible GPUs), -1 on CPU
  int gpus_visible = 0;
};

class Runtime {
 public:
  // MPI_Init (idempotent) and placement. Safe to call in tests where MPI is already initialised.
  static Runtime& init(int* argc, char*** argv);
  static Runtime& get();
  const Placement& where() const { return place_; }
  Comm& world() { return *world_; }
  Comm& node_comm() { return *node_; }

  // Rank 0 parses the deck and broadcasts the resolved text; every rank returns the same Deck.
  // A deck error is collective: every rank throws the same message.
  Deck load_deck(const std::string& path, const std::vector<std::string>& overrides, const std::string& mode);

  // runtime.timeout on the world and node communicators (split() passes it on) and the liveness watchdog
  // (runtime/watchdog.hpp), which the first call starts. Collective.
  void set_timeout(double seconds);

  // Gather per-region timers into the exit table (rank 0 prints min/avg/max over ranks).
  std::string timing_table();

  void finalize();

 private:
  Placement place_;
  std::unique_ptr<Comm> world_, node_;
};

// Collective over `c`, for checks each rank makes for itself (a path it will write): when any rank has a
// problem (err not empty), every rank fails with the lowest such rank's message, which names that rank and host
// when there are several ranks, and it is printed once.
void agree_or_fail(Comm& c, const std::string& err);

// Where rank 0 alone works (generate, eval, synth) and the others wait for it: no deadline (the work may take
// hours), but a silent rank still ends the job (the liveness watchdog). Collective.
void idle_barrier(Comm& c, const std::string& what);

// This node's memory the kernel can give without swapping (/proc/meminfo's MemAvailable, else the free pages):
// what serve's KV cache on the CPU and train's optimizer offload are sized and checked against.
int64_t available_memory();

// How the app ends a run on an error (see core/error.hpp for the two kinds).
[[noreturn]] void exit_collective(const std::string& msg);  // rank 0 prints, all finalize, exit 1
// This rank prints with rank and host, then MPI_Abort (one rank: finalize and exit 1). MPICH's own
// "Abort(1) on node ..." line is kept off stderr: ours says more. Callable from the watchdog's thread.
[[noreturn]] void abort_local(const std::string& msg);

}  // namespace q3vl
