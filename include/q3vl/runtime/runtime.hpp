// The MPI process: init/finalize, where this rank runs (host, node, local rank, GPU), the world
// communicator, the resolved deck on every rank, and how errors end the run.
#pragma once
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

  // Gather per-region timers into the exit table (rank 0 prints min/avg/max over ranks).
  std::string timing_table();

  void finalize();

 private:
  Placement place_;
  std::unique_ptr<Comm> world_, node_;
};

// How the app ends a run on an error (see core/error.hpp for the two kinds).
[[noreturn]] void exit_collective(const std::string& msg);  // rank 0 prints, all finalize, exit 1
[[noreturn]] void abort_local(const std::string& msg);      // this rank prints with rank+host, MPI_Abort

}  // namespace q3vl
