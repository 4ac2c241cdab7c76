// Comm over MPI, with MPI-4 large counts (a ZeRO unit of a 235B MoE layer exceeds 2^31 elements).
#include "q3vl/runtime/mpi_comm.hpp"

#include <mpi.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <thread>

#include <unistd.h>

#include "q3vl/core/error.hpp"
#include "q3vl/runtime/stop.hpp"
#include "q3vl/runtime/watchdog.hpp"
#include "q3vl/tensor/profile.hpp"

namespace q3vl {

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::BF16: case DType::F16: return MPI_UINT16_T;  // moved as bits; reductions refuse them below
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op, DType t, const char* what) {
  if (t == DType::BF16 || t == DType::F16)
    fail(std::string("mpi ") + what + ": reductions on " + dtype_name(t) + " are not supported; reduce in fp32");
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

std::vector<MPI_Count> to_counts(const std::vector<size_t>& v) { return {v.begin(), v.end()}; }
std::vector<MPI_Aint> to_displs(const std::vector<size_t>& v) { return {v.begin(), v.end()}; }

class MpiRequest : public CommRequest {
 public:
  explicit MpiRequest(std::string what) : CommRequest(std::move(what)) {}
  bool test() override {
    int done = 0;
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    return done;
  }
  MPI_Request req = MPI_REQUEST_NULL;
  // Uneven collectives keep their count arrays alive until completion.
  std::vector<MPI_Count> c1, c2;
  std::vector<MPI_Aint> d1, d2;
};

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fail(std::string("mpi ") + what + " failed: " + std::string(msg, len));
  }
}

// Counts the collective as it starts, so a rank that never gets here stays behind on the board.
std::unique_ptr<MpiRequest> start(Comm& c, const char* what, double bytes = 0) {
  auto r = std::make_unique<MpiRequest>(what);
  r->seq = c.begin_collective();
  r->bytes = bytes;
  return r;
}

class MpiBoard : public ProgressBoard {
 public:
  explicit MpiBoard(MPI_Comm comm) : slots_(comm) {}
  void publish(long seq) override { slots_.store(seq); }
  long read(int rank) const override {
    int64_t v = 0;
    return slots_.load(rank, &v) ? long(v) : -1;
  }

 private:
  NodeSlots slots_;
};

// True while an exception unwinds the stack: a peer that hung or failed may never join a collective free, so
// destructors leak their MPI objects instead (the process is about to end).
bool unwinding() { return std::uncaught_exceptions() > 0; }

// "0-3,6" from sorted ranks.
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += (s.empty() ? "" : ",") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return s;
}

}  // namespace

NodeSlots::NodeSlots(MPI_Comm comm) {
  int size = 0, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  check(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm_), "board split");
  int local_size = 0;
  MPI_Comm_size(shm_, &local_size);
  int64_t* mine = nullptr;
  check(MPI_Win_allocate_shared(sizeof(int64_t), sizeof(int64_t), MPI_INFO_NULL, shm_, &mine, &win_),
        "board window");
  *mine = 0;
  MPI_Win_lock_all(MPI_MODE_NOCHECK, win_);  // one passive epoch for the window's lifetime
  mine_ = mine;
  // Which rank of `comm` owns each local slot.
  std::vector<int> owner(size_t(local_size), 0);
  check(MPI_Allgather(&rank, 1, MPI_INT, owner.data(), 1, MPI_INT, shm_), "board owners");
  slots_.assign(size_t(size), nullptr);
  for (int l = 0; l < local_size; ++l) {
    MPI_Aint bytes = 0;
    int disp = 0;
    int64_t* p = nullptr;
    check(MPI_Win_shared_query(win_, l, &bytes, &disp, &p), "board query");
    slots_[size_t(owner[size_t(l)])] = p;
  }
  MPI_Barrier(shm_);  // every slot is zeroed before anyone reads it
}

NodeSlots::~NodeSlots() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || unwinding()) return;  // MPI_Win_free is collective (a barrier in MPICH)
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);
  MPI_Comm_free(&shm_);
}

void NodeSlots::store(int64_t v) { std::atomic_ref<int64_t>(*mine_).store(v, std::memory_order_release); }

bool NodeSlots::load(int rank, int64_t* v) const {
  int64_t* p = slots_[size_t(rank)];
  if (p) *v = std::atomic_ref<int64_t>(*p).load(std::memory_order_acquire);
  return p;
}

std::unique_ptr<ProgressBoard> make_mpi_board(MPI_Comm comm) { return std::make_unique<MpiBoard>(comm); }

MpiComm::MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  board_ = make_mpi_board(comm_);
  // World ranks for messages: a rank of a sub-communicator means nothing to the user.
  MPI_Group g = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm_, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> mine(size_t(size_), 0);
  std::iota(mine.begin(), mine.end(), 0);
  world_ranks_.assign(size_t(size_), 0);
  MPI_Group_translate_ranks(g, size_, mine.data(), world, world_ranks_.data());
  MPI_Group_free(&g);
  MPI_Group_free(&world);
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  board_.reset();
  if (owned_ && !finalized && !unwinding()) MPI_Comm_free(&comm_);
}

std::unique_ptr<CommRequest> MpiComm::iall_gather(const void* send, void* recv, size_t count, DType t) {
  auto r = start(*this, "all_gather", coll_bytes(count * size_t(size_), t));
  check(MPI_Iallgather_c(send, count, mpi_type(t), recv, count, mpi_type(t), comm_, &r->req), "all_gather");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::ireduce_scatter(const void* send, void* recv, size_t count, DType t,
                                                      ReduceOp op) {
  auto r = start(*this, "reduce_scatter", coll_bytes(count * size_t(size_), t));
  check(MPI_Ireduce_scatter_block_c(send, recv, count, mpi_type(t), mpi_op(op, t, "reduce_scatter"), comm_, &r->req),
        "reduce_scatter");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::iall_reduce(const void* send, void* recv, size_t count, DType t, ReduceOp op) {
  auto r = start(*this, "all_reduce", coll_bytes(count, t));
  check(MPI_Iallreduce_c(send == recv ? MPI_IN_PLACE : send, recv, count, mpi_type(t), mpi_op(op, t, "all_reduce"),
                         comm_, &r->req),
        "all_reduce");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::ibroadcast(void* buf, size_t count, DType t, int root) {
  auto r = start(*this, "broadcast", coll_bytes(count, t));
  check(MPI_Ibcast_c(buf, count, mpi_type(t), root, comm_, &r->req), "broadcast");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::iall_to_all(const void* send, void* recv, size_t count, DType t) {
  auto r = start(*this, "all_to_all", coll_bytes(count * size_t(size_), t));
  check(MPI_Ialltoall_c(send, count, mpi_type(t), recv, count, mpi_type(t), comm_, &r->req), "all_to_all");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::iall_gatherv(const void* send, size_t send_count, void* recv,
                                                   const std::vector<size_t>& counts,
                                                   const std::vector<size_t>& displs, DType t) {
  Q3VL_CHECK(int(counts.size()) == size_ && int(displs.size()) == size_, "all_gatherv needs one count per rank");
  auto r = start(*this, "all_gatherv", coll_bytes(counts, t));
  r->c1 = to_counts(counts);
  r->d1 = to_displs(displs);
  check(MPI_Iallgatherv_c(send, send_count, mpi_type(t), recv, r->c1.data(), r->d1.data(), mpi_type(t), comm_,
                          &r->req),
        "all_gatherv");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::ireduce_scatterv(const void* send, void* recv, const std::vector<size_t>& counts,
                                                       DType t, ReduceOp op) {
  Q3VL_CHECK(int(counts.size()) == size_, "reduce_scatterv needs one count per rank");
  auto r = start(*this, "reduce_scatterv", coll_bytes(counts, t));
  r->c1 = to_counts(counts);
  check(MPI_Ireduce_scatter_c(send, recv, r->c1.data(), mpi_type(t), mpi_op(op, t, "reduce_scatterv"), comm_,
                              &r->req),
        "reduce_scatterv");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::iall_to_allv(const void* send, const std::vector<size_t>& send_counts,
                                                   const std::vector<size_t>& send_displs, void* recv,
                                                   const std::vector<size_t>& recv_counts,
                                                   const std::vector<size_t>& recv_displs, DType t) {
  Q3VL_CHECK(int(send_counts.size()) == size_ && int(recv_counts.size()) == size_ &&
                 int(send_displs.size()) == size_ && int(recv_displs.size()) == size_,
             "all_to_allv needs one count and displacement per rank");
  auto r = start(*this, "all_to_allv", coll_bytes(send_counts, t));
  r->c1 = to_counts(send_counts);
  r->d1 = to_displs(send_displs);
  r->c2 = to_counts(recv_counts);
  r->d2 = to_displs(recv_displs);
  check(MPI_Ialltoallv_c(send, r->c1.data(), r->d1.data(), mpi_type(t), recv, r->c2.data(), r->d2.data(),
                         mpi_type(t), comm_, &r->req),
        "all_to_allv");
  return r;
}

std::unique_ptr<CommRequest> MpiComm::ibarrier() {
  auto r = start(*this, "barrier");
  check(MPI_Ibarrier(comm_, &r->req), "barrier");
  return r;
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) const {
  MPI_Comm sub;
  check(MPI_Comm_split(comm_, color, key, &sub), "comm_split");
  auto c = std::make_unique<MpiComm>(sub, true);
  c->set_timeout(timeout());  // the watchdog covers sub-communicators too (ZeRO's gathers, hybrid groups)
  return c;
}

std::string Comm::where() {
  std::string s = step_ >= 0 ? " at step " + std::to_string(step_) : std::string();
  if (phase_) s += (s.empty() ? " in " : " (") + std::string(phase_) + (step_ >= 0 ? ")" : "");
  return s;
}

void Comm::wait(std::unique_ptr<CommRequest> req) {
  using clock = std::chrono::steady_clock;
  prof::Scope prof_scope;  // the host blocked on the collective (run.profile)
  if (prof::on()) [[unlikely]]
    prof_scope.begin(dev::Exec{}, prof::intern(kind() + " " + req->what()), prof::mem(req->bytes),
                     prof::Kind::CommWait);
  auto t0 = clock::now();
  long spins = 0;
  while (!req->test()) {
    // Poll tight first (small collectives finish in microseconds), then back off to spare the cores.
    if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(spins > 100000 ? 1000 : 50));
    if (spins % 64) continue;
    const bool term = stop_signal_pending() == SIGTERM;
    const double limit = term && (timeout_ <= 0 || timeout_ > kTermGrace) ? kTermGrace : timeout_;
    const double waited = std::chrono::duration<double>(clock::now() - t0).count();
    if (limit > 0 && waited > limit) {
      char host[256] = "?", limit_text[96];
      gethostname(host, sizeof host);
      if (term) std::snprintf(limit_text, sizeof limit_text, "%g s (SIGTERM received; runtime.timeout = %g s)", limit, timeout_);
      else std::snprintf(limit_text, sizeof limit_text, "runtime.timeout = %g s", limit);
      abort_inflight();
      const std::string silent = watchdog_silent(kSilentSeconds);
      // Local kind: the app aborts the job; the peers may be stuck where they are.
      fail("watchdog: collective " + req->what() + (req->seq > 0 ? " #" + std::to_string(req->seq) : "") +
           " on a " + std::to_string(size()) + "-rank " + kind() + " communicator did not complete within " +
           limit_text + where() + "; " +
           stragglers(req->seq, silent) + " (rank " + std::to_string(world_rank(rank())) + " on " + host + " waited)");
    }
  }
}

std::string Comm::stragglers(long seq, const std::string& silent) const {
  // A rank that stopped inside the collective has started it too: only its silence names it.
  const std::string stopped = silent.empty() ? "" : "no sign of life from " + silent + " (stopped or dead?)";
  if (!board_ || seq <= 0) return stopped.empty() ? "the ranks that did not arrive are unknown" : stopped;
  std::vector<int> behind, unknown;
  std::string detail;
  for (int r = 0; r < size(); ++r) {
    long s = board_->read(r);
    if (s < 0) unknown.push_back(world_rank(r));
    else if (s < seq) {
      behind.push_back(world_rank(r));
      if (behind.size() <= 8)
        detail += (detail.empty() ? "" : ", ") + std::to_string(world_rank(r)) + " at #" + std::to_string(s);
    }
  }
  std::sort(behind.begin(), behind.end());
  std::sort(unknown.begin(), unknown.end());
  std::string out;
  if (!behind.empty())
    out = "ranks that did not arrive: " + rank_ranges(behind) + " (" + detail + (behind.size() > 8 ? ", ..." : "") +
          ")";
  if (!unknown.empty())
    out += (out.empty() ? "" : "; ") + std::string("not known for ranks on other nodes: ") + rank_ranges(unknown);
  if (!stopped.empty()) return out.empty() ? stopped : out + "; " + stopped;
  return out.empty() ? "every rank started collective #" + std::to_string(seq) +
                           ": the ranks called different collectives, or the transport stalled"
                     : out;
}

std::unique_ptr<CommRequest> Comm::ifence(const char* what) {
  struct Done : CommRequest {
    explicit Done(const char* w) : CommRequest(w) {}
    bool test() override { return true; }
  };
  return std::make_unique<Done>(what);
}

void Comm::broadcast_string(std::string& s, int root) {
  int64_t n = int64_t(s.size());
  broadcast(&n, 1, DType::I64, root);
  s.resize(size_t(n));
  if (n > 0) broadcast(s.data(), size_t(n), DType::U8, root);
}

}  // namespace q3vl
