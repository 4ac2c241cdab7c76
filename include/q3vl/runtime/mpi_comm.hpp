#pragma once
#include <mpi.h>

#include <cstdint>
#include <vector>

#include "q3vl/runtime/comm.hpp"

namespace q3vl {

// One 64-bit slot per rank of `comm` in a shared-memory window among the ranks of each node: a rank writes its
// own slot and reads those of the ranks on its node (atomically, without their help); ranks on other nodes have
// none here. Collective over `comm` to build and to free.
class NodeSlots {
 public:
  explicit NodeSlots(MPI_Comm comm);
  ~NodeSlots();
  NodeSlots(const NodeSlots&) = delete;
  NodeSlots& operator=(const NodeSlots&) = delete;
  void store(int64_t v);
  bool load(int rank, int64_t* v) const;  // false: `rank` is on another node
  int size() const { return int(slots_.size()); }

 private:
  MPI_Comm shm_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  int64_t* mine_ = nullptr;
  std::vector<int64_t*> slots_;  // by rank of the communicator; null on other nodes
};

// A ProgressBoard over `comm`: a shared-memory window among the ranks of `comm` on this node (one
// 64-bit counter each); ranks on other nodes read as -1. Collective over `comm`.
std::unique_ptr<ProgressBoard> make_mpi_board(MPI_Comm comm);

class MpiComm : public Comm {
 public:
  // Wraps `comm`; frees it on destruction when `owned`.
  explicit MpiComm(MPI_Comm comm, bool owned = false);
  ~MpiComm() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string kind() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }
  int world_rank(int r) const override { return world_ranks_[size_t(r)]; }

  std::unique_ptr<CommRequest> iall_gather(const void* send, void* recv, size_t count, DType t) override;
  std::unique_ptr<CommRequest> ireduce_scatter(const void* send, void* recv, size_t count, DType t,
                                               ReduceOp op) override;
  std::unique_ptr<CommRequest> iall_reduce(const void* send, void* recv, size_t count, DType t, ReduceOp op) override;
  std::unique_ptr<CommRequest> ibroadcast(void* buf, size_t count, DType t, int root) override;
  std::unique_ptr<CommRequest> iall_to_all(const void* send, void* recv, size_t count, DType t) override;
  std::unique_ptr<CommRequest> iall_gatherv(const void* send, size_t send_count, void* recv,
                                            const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                                            DType t) override;
  std::unique_ptr<CommRequest> ireduce_scatterv(const void* send, void* recv, const std::vector<size_t>& counts,
                                                DType t, ReduceOp op) override;
  std::unique_ptr<CommRequest> iall_to_allv(const void* send, const std::vector<size_t>& send_counts,
                                            const std::vector<size_t>& send_displs, void* recv,
                                            const std::vector<size_t>& recv_counts,
                                            const std::vector<size_t>& recv_displs, DType t) override;
  std::unique_ptr<CommRequest> ibarrier() override;
  std::unique_ptr<Comm> split(int color, int key) const override;

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;  // MPI_COMM_WORLD rank of each rank of comm_
};

}  // namespace q3vl
