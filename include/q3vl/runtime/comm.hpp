// Communicator interface on flat buffers. The MPI implementation is here; NCCL implements the same
// interface for device buffers. Every collective starts nonblocking and is waited on with a deadline
// (runtime.timeout): a collective that does not complete in time fails naming itself, the step and the
// ranks that did not arrive, instead of hanging the job. Sub-communicators made by split() inherit the timeout;
// ranks are named by their MPI_COMM_WORLD rank. After SIGTERM a wait gives up sooner (kTermGrace), so that a
// job with a stopped rank still ends when it is cancelled.
//
// Naming the ranks that did not arrive: before each collective a rank publishes how many collectives
// it has started on the communicator (its sequence number) on a ProgressBoard that the others can read
// without the stuck rank's help (MPI: a shared-memory window among the ranks of one node). On timeout
// the waiting rank names the ranks whose number is behind its own; ranks on other nodes are "unknown".
//
// NCCL seam: NcclComm creates its communicator nonblocking (ncclCommInitRankConfig, blocking = 0) and
// its requests' test() polls ncclCommGetAsyncError, so init and collectives both wait here under the
// same deadline; its abort_inflight() calls ncclCommAbort so that kernels blocked on a peer are
// released before the app's MPI_Abort. It keeps an MpiBoard of its bootstrap MPI communicator.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/dtype.hpp"

namespace q3vl {

enum class ReduceOp { Sum, Max, Min };

// Bytes of `count` elements of t, or of the sum of `counts` (what a collective moves, for the profiler).
inline double coll_bytes(size_t count, DType t) { return double(count) * double(dtype_size(t)); }
inline double coll_bytes(const std::vector<size_t>& counts, DType t) {
  size_t n = 0;
  for (size_t c : counts) n += c;
  return coll_bytes(n, t);
}

// An in-flight collective.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;  // true once complete
  const std::string& what() const { return what_; }
  long seq = 0;  // this rank's sequence number of the collective (0: not counted)
  double bytes = 0;    // what it moves per rank (the profiler's GB/s, tensor/profile.hpp)

 protected:
  explicit CommRequest(std::string what) : what_(std::move(what)) {}
  std::string what_;
};

// Each rank's latest collective sequence number, readable by the other ranks.
class ProgressBoard {
 public:
  virtual ~ProgressBoard() = default;
  virtual void publish(long seq) = 0;
  virtual long read(int rank) const = 0;  // -1: not readable from here (another node)
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string kind() const = 0;  // "mpi", "nccl"
  virtual int world_rank(int r) const { return r; }  // rank r of this communicator in MPI_COMM_WORLD

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
  // Completes when the device work queued so far on the collectives' stream has passed (NCCL: an event recorded now,
  // e.g. behind a replayed CUDA graph that holds collectives). Counted like a collective, so that a rank that never
  // gets there is named; every rank of the group must fence at the same points. Host communicators queue nothing on a
  // device: complete at once.
  virtual std::unique_ptr<CommRequest> ifence(const char* what);
  // Sub-communicator of the ranks with the same color, ordered by key.
  virtual std::unique_ptr<Comm> split(int color, int key) const = 0;

  // Wait for a request; past the deadline, fail (a local error: the app aborts the job) naming the
  // collective, the step and the ranks that did not arrive.
  void wait(std::unique_ptr<CommRequest> req);

  // Implementations call this as they start a collective: counts it and publishes the count.
  long begin_collective() {
    if (board_) board_->publish(++seq_);
    return seq_;
  }
  // Cancel what is in flight after a timeout (NCCL: ncclCommAbort); MPI has nothing to cancel.
  virtual void abort_inflight() {}

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

  // Watchdog settings: seconds a collective may take (<= 0: forever), and the step and phase ("forward",
  // "checkpoint write", ...) named in messages.
  void set_timeout(double seconds) { timeout_ = seconds; }
  double timeout() const { return timeout_; }
  static void set_step(long step) { step_ = step; }
  static long step() { return step_; }
  static void set_phase(const char* phase) { phase_ = phase; }
  static const char* phase() { return phase_; }
  // " at step N (phase)", or "" before the first step: the tail of watchdog messages.
  static std::string where();
  // Seconds a collective still waits once SIGTERM has arrived (when runtime.timeout is longer).
  static constexpr double kTermGrace = 10;

 private:
  double timeout_ = 0;
  static inline long step_ = -1;
  static inline const char* phase_ = nullptr;

 protected:
  // Who is behind collective #seq, from the board, and who is silent (watchdog_silent), for the watchdog's message.
  std::string stragglers(long seq, const std::string& silent = "") const;
  std::unique_ptr<ProgressBoard> board_;
  long seq_ = 0;
};

}  // namespace q3vl
