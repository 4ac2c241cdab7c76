// Comm over NCCL (nccl_comm.hpp). Host code only: NCCL's kernels are its own.
#include "q3vl/runtime/nccl_comm.hpp"

#include "q3vl/core/error.hpp"

#ifndef Q3VL_CUDA
namespace q3vl {
std::unique_ptr<Comm> make_nccl_comm(MPI_Comm, const dev::Exec&, double) {
  fail("NCCL needs a q3vl built with CUDA (make CUDA=1)");
}
std::string nccl_version() { return "none"; }
}  // namespace q3vl
#else
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <exception>
#include <thread>

#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/tensor/profile.hpp"

namespace q3vl {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

bool unwinding() { return std::uncaught_exceptions() > 0; }

class NcclComm;

// Completes when the event recorded behind the collective on the stream has passed.
class NcclRequest : public CommRequest {
 public:
  NcclRequest(NcclComm& c, const char* what, cudaEvent_t ev) : CommRequest(what), c_(c), ev_(ev) {}
  ~NcclRequest() override;
  bool test() override;

 private:
  NcclComm& c_;
  cudaEvent_t ev_;
};

class NcclComm : public Comm {
 public:
  NcclComm(MPI_Comm bootstrap, const dev::Exec& x, double timeout) : boot_(dup(bootstrap), true), x_(x) {
    Q3VL_CHECK(x.device == Device::CUDA, "an NCCL communicator needs a CUDA Exec");
    set_timeout(timeout);
    board_ = make_mpi_board(boot_.handle());
    ncclUniqueId id{};
    if (boot_.rank() == 0) check(ncclGetUniqueId(&id), "get unique id", __LINE__);
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, boot_.handle());
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // init and every call return at once; Comm::wait polls them under the deadline
    const long seq = begin_collective();
    check(ncclCommInitRankConfig(&comm_, boot_.size(), id, boot_.rank(), &cfg), "init", __LINE__);
    struct Init : CommRequest {
      NcclComm& c;
      Init(NcclComm& c, long s) : CommRequest("nccl init"), c(c) { seq = s; }
      bool test() override { return c.settled("init"); }
    };
    wait(std::make_unique<Init>(*this, seq));
    if (cudaMalloc(&one_, 8) != cudaSuccess) fail("nccl: cudaMalloc of 8 bytes for barriers failed");
  }

  ~NcclComm() override {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
    if (one_) cudaFree(one_);
    if (!comm_) return;
    // A healthy communicator flushes and is destroyed; one a peer may never join again is aborted.
    const ncclResult_t fin = unwinding() ? ncclInternalError : ncclCommFinalize(comm_);
    if (fin != ncclSuccess && fin != ncclInProgress) {
      ncclCommAbort(comm_);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    ncclResult_t st = ncclInProgress;
    while (ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st == ncclInProgress &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::yield();
    if (st == ncclSuccess) ncclCommDestroy(comm_);
    else ncclCommAbort(comm_);
  }

  int rank() const override { return boot_.rank(); }
  int size() const override { return boot_.size(); }
  std::string kind() const override { return "nccl"; }
  int world_rank(int r) const override { return boot_.world_rank(r); }

  std::unique_ptr<CommRequest> iall_gather(const void* send, void* recv, size_t count, DType t) override {
    return issue("all_gather", coll_bytes(count * size_t(size()), t),
                 [&] { return ncclAllGather(send, recv, count, nccl_type(t), comm_, stream()); });
  }
  std::unique_ptr<CommRequest> ireduce_scatter(const void* send, void* recv, size_t count, DType t,
                                               ReduceOp op) override {
    return issue("reduce_scatter", coll_bytes(count * size_t(size()), t), [&] {
      return ncclReduceScatter(send, recv, count, nccl_type(t), nccl_op(op), comm_, stream());
    });
  }
  std::unique_ptr<CommRequest> iall_reduce(const void* send, void* recv, size_t count, DType t,
                                           ReduceOp op) override {
    return issue("all_reduce", coll_bytes(count, t),
                 [&] { return ncclAllReduce(send, recv, count, nccl_type(t), nccl_op(op), comm_, stream()); });
  }
  std::unique_ptr<CommRequest> ibroadcast(void* buf, size_t count, DType t, int root) override {
    return issue("broadcast", coll_bytes(count, t),
                 [&] { return ncclBroadcast(buf, buf, count, nccl_type(t), root, comm_, stream()); });
  }
  // The uneven and all-to-all exchanges are point-to-point pairs in one NCCL group (NCCL has no v-collectives).
  std::unique_ptr<CommRequest> iall_to_all(const void* send, void* recv, size_t count, DType t) override {
    const size_t n = size_t(size());
    std::vector<size_t> c(n, count), d(n, 0);
    for (int q = 0; q < size(); ++q) d[size_t(q)] = size_t(q) * count;
    return exchange("all_to_all", send, c, d, recv, c, d, t);
  }
  std::unique_ptr<CommRequest> iall_gatherv(const void* send, size_t send_count, void* recv,
                                            const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                                            DType t) override {
    Q3VL_CHECK(int(counts.size()) == size() && int(displs.size()) == size(), "all_gatherv needs one count per rank");
    return exchange("all_gatherv", send, std::vector<size_t>(size_t(size()), send_count),
                    std::vector<size_t>(size_t(size()), 0), recv, counts, displs, t);
  }
  std::unique_ptr<CommRequest> ireduce_scatterv(const void* send, void* recv, const std::vector<size_t>& counts,
                                                DType t, ReduceOp op) override {
    Q3VL_CHECK(int(counts.size()) == size(), "reduce_scatterv needs one count per rank");
    return issue("reduce_scatterv", coll_bytes(counts, t), [&] {  // block q reduced to rank q
      ncclResult_t rc = ncclGroupStart();
      size_t off = 0;
      for (int q = 0; q < size() && rc == ncclSuccess; off += counts[size_t(q)], ++q)
        rc = ncclReduce(static_cast<const char*>(send) + off * dtype_size(t), recv, counts[size_t(q)], nccl_type(t),
                        nccl_op(op), q, comm_, stream());
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess ? rc : end;
    });
  }
  std::unique_ptr<CommRequest> iall_to_allv(const void* send, const std::vector<size_t>& send_counts,
                                            const std::vector<size_t>& send_displs, void* recv,
                                            const std::vector<size_t>& recv_counts,
                                            const std::vector<size_t>& recv_displs, DType t) override {
    Q3VL_CHECK(int(send_counts.size()) == size() && int(recv_counts.size()) == size() &&
                   int(send_displs.size()) == size() && int(recv_displs.size()) == size(),
               "all_to_allv needs one count and displacement per rank");
    return exchange("all_to_allv", send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
  }
  std::unique_ptr<CommRequest> ibarrier() override {
    return issue("barrier", 4, [&] { return ncclAllReduce(one_, one_, 1, ncclInt32, ncclSum, comm_, stream()); });
  }
  std::unique_ptr<CommRequest> ifence(const char* what) override {
    return issue(what, 0, [] { return ncclSuccess; });  // the event behind what the stream holds
  }

  std::unique_ptr<Comm> split(int color, int key) const override {
    MPI_Comm sub;
    MPI_Comm_split(boot_.handle(), color, key, &sub);
    auto c = std::make_unique<NcclComm>(sub, x_, timeout());
    MPI_Comm_free(&sub);
    return c;
  }
  void abort_inflight() override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // True once the last call has been taken (not ncclInProgress); fails on an asynchronous error.
  bool settled(const char* what) {
    Q3VL_CHECK(comm_, std::string("nccl ") + what + ": the communicator was aborted after an earlier timeout");
    ncclResult_t st = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &st), what, __LINE__);
    if (st == ncclInProgress) return false;
    check(st, what, __LINE__);
    return true;
  }
  void give_back(cudaEvent_t e) { free_.push_back(e); }

 private:
  static MPI_Comm dup(MPI_Comm c) {
    MPI_Comm d;
    MPI_Comm_dup(c, &d);
    return d;
  }
  cudaStream_t stream() const { return static_cast<cudaStream_t>(x_.stream); }
  void check(ncclResult_t rc, const char* what, int line) const {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    const char* last = comm_ ? ncclGetLastError(comm_) : nullptr;
    fail(std::string(__FILE__ ":") + std::to_string(line) + ": nccl " + what + " failed on rank " +
         std::to_string(world_rank(rank())) + ": " + ncclGetErrorString(rc) +
         (last && *last ? std::string(" (") + last + ")" : std::string()));
  }

  // Starts a collective: counted on the board, enqueued (a nonblocking communicator may take the call later: wait
  // until it has, so that the next call finds it in order), an event recorded behind it.
  // run.profile times it on the stream (events before the call and after NCCL has taken it).
  template <class F>
  std::unique_ptr<CommRequest> issue(const char* what, double bytes, F&& call) {
    const long seq = begin_collective();
    Q3VL_CHECK(comm_, std::string("nccl ") + what + ": the communicator was aborted after an earlier timeout");
    prof::Scope prof_scope;
    if (prof::on()) [[unlikely]]
      prof_scope.begin(x_, prof::intern(std::string("nccl ") + what), prof::mem(bytes), prof::Kind::Collective);
    check(call(), what, __LINE__);
    struct Enqueue : CommRequest {
      NcclComm& c;
      Enqueue(NcclComm& c, const char* w, long s) : CommRequest(w), c(c) { seq = s; }
      bool test() override { return c.settled(what_.c_str()); }
    };
    wait(std::make_unique<Enqueue>(*this, what, seq));
    cudaEvent_t e = nullptr;
    if (!free_.empty()) e = free_.back(), free_.pop_back();
    else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess)
      fail(std::string("nccl ") + what + ": cudaEventCreate failed");
    cudaEventRecord(e, stream());
    auto r = std::make_unique<NcclRequest>(*this, what, e);
    r->seq = seq;
    r->bytes = bytes;
    return r;
  }

  std::unique_ptr<CommRequest> exchange(const char* what, const void* send, const std::vector<size_t>& sc,
                                        const std::vector<size_t>& sd, void* recv, const std::vector<size_t>& rc,
                                        const std::vector<size_t>& rd, DType t) {
    const size_t es = dtype_size(t);
    return issue(what, coll_bytes(sc, t), [&] {
      ncclResult_t r = ncclGroupStart();
      for (int q = 0; q < size() && r == ncclSuccess; ++q) {
        const size_t i = size_t(q);
        if (sc[i]) r = ncclSend(static_cast<const char*>(send) + sd[i] * es, sc[i], nccl_type(t), q, comm_, stream());
        if (r == ncclSuccess && rc[i])
          r = ncclRecv(static_cast<char*>(recv) + rd[i] * es, rc[i], nccl_type(t), q, comm_, stream());
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  MpiComm boot_;  // the ranks, their world numbers, and the bootstrap of split()
  dev::Exec x_;
  ncclComm_t comm_ = nullptr;
  void* one_ = nullptr;  // barrier's operand
  std::vector<cudaEvent_t> free_;
};

NcclRequest::~NcclRequest() { c_.give_back(ev_); }

bool NcclRequest::test() {
  c_.settled(what_.c_str());
  const cudaError_t e = cudaEventQuery(ev_);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) fail("nccl " + what_ + ": " + cudaGetErrorString(e));
  return true;
}

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(MPI_Comm bootstrap, const dev::Exec& x, double timeout) {
  return std::make_unique<NcclComm>(bootstrap, x, timeout);
}

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace q3vl
#endif
