#pragma once
#include <mpi.h>

#include "q3vl/runtime/comm.hpp"

namespace q3vl {

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
};

}  // namespace q3vl
