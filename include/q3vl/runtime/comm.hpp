// Communicator interface on flat buffers. The MPI implementation is here; NCCL implements the same
// interface for device buffers. Every collective starts nonblocking and is waited on with a deadline
// (runtime.timeout): a collective that does not complete in time fails naming itself, the step and the
// ranks that did not arrive, instead of hanging the job.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/dtype.hpp"

namespace q3vl {

enum class ReduceOp { Sum, Max, Min };

// An in-flight collective.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;  // true once complete
  const std::string& what() const { return what_; }

 protected:
  explicit CommRequest(std::string what) : what_(std::move(what)) {}
  std::string what_;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;  // "mpi", "nccl"

  // Nonblocking collectives. `count` is per rank where a collective has one block per rank.
  // all_gather: send[count] -> recv[size*count] (rank r's block at r*count).
  virtual std::unique_ptr<CommRequest> iall_gather(const void* send, void* recv, size_t count, DType t) = 0;
  // reduce_scatter: send[size*count] -> recv[count] = op over ranks of their block `rank`.
  virtual std::unique_ptr<CommRequest> ireduce_scatter(const void* send, void* recv, size_t count, DType t,
                                                       ReduceOp op) = 0;
  // all_reduce: in place when send == recv.
  virtual std::unique_ptr<CommRequest> iall_reduce(const void* send, void* recv, size_t count, DType t,
                                                   ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> ibroadcast(void* buf, size_t count, DType t, int root) = 0;
  // all_to_all: send[size*count] -> recv[size*count]; block r goes to rank r.
  virtual std::unique_ptr<CommRequest> iall_to_all(const void* send, void* recv, size_t count, DType t) = 0;
  // Uneven versions: counts and displacements in elements, one per rank.
  virtual std::unique_ptr<CommRequest> iall_gatherv(const void* send, size_t send_count, void* recv,
                                                    const std::vector<size_t>& counts,
                                                    const std::vector<size_t>& displs, DType t) = 0;
  virtual std::unique_ptr<CommRequest> ireduce_scatterv(const void* send, void* recv,
                                                        const std::vector<size_t>& counts, DType t,
                                                        ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> iall_to_allv(const void* send, const std::vector<size_t>& send_counts,
                                                    const std::vector<size_t>& send_displs, void* recv,
                                                    const std::vector<size_t>& recv_counts,
                                                    const std::vector<size_t>& recv_displs, DType t) = 0;
  virtual std::unique_ptr<CommRequest> ibarrier() = 0;
  // Sub-communicator of the ranks with the same color, ordered by key.
  virtual std::unique_ptr<Comm> split(int color, int key) const = 0;

  // Wait for a request; past the deadline, fail naming the collective and the step.
  void wait(std::unique_ptr<CommRequest> req);

  // Blocking forms: start and wait.
  void all_gather(const void* send, void* recv, size_t count, DType t) { wait(iall_gather(send, recv, count, t)); }
  void reduce_scatter(const void* send, void* recv, size_t count, DType t, ReduceOp op = ReduceOp::Sum) {
    wait(ireduce_scatter(send, recv, count, t, op));
  }
  void all_reduce(void* buf, size_t count, DType t, ReduceOp op = ReduceOp::Sum) {
    wait(iall_reduce(buf, buf, count, t, op));
  }
  void broadcast(void* buf, size_t count, DType t, int root) { wait(ibroadcast(buf, count, t, root)); }
  void all_to_all(const void* send, void* recv, size_t count, DType t) { wait(iall_to_all(send, recv, count, t)); }
  void all_gatherv(const void* send, size_t send_count, void* recv, const std::vector<size_t>& counts,
                   const std::vector<size_t>& displs, DType t) {
    wait(iall_gatherv(send, send_count, recv, counts, displs, t));
  }
  void reduce_scatterv(const void* send, void* recv, const std::vector<size_t>& counts, DType t,
                       ReduceOp op = ReduceOp::Sum) {
    wait(ireduce_scatterv(send, recv, counts, t, op));
  }
  void all_to_allv(const void* send, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_displs,
                   void* recv, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                   DType t) {
    wait(iall_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, t));
  }
  void barrier() { wait(ibarrier()); }

  // Convenience on scalars and strings.
  double sum(double x) { all_reduce(&x, 1, DType::F64, ReduceOp::Sum); return x; }
  double max(double x) { all_reduce(&x, 1, DType::F64, ReduceOp::Max); return x; }
  double min(double x) { all_reduce(&x, 1, DType::F64, ReduceOp::Min); return x; }
  void broadcast_string(std::string& s, int root);

  // Watchdog settings: seconds a collective may take (<= 0: forever), and the step named in messages.
  void set_timeout(double seconds) { timeout_ = seconds; }
  double timeout() const { return timeout_; }
  static void set_step(long step) { step_ = step; }

 private:
  double timeout_ = 0;
  static inline long step_ = -1;
};

}  // namespace q3vl
