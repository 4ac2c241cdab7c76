#include "q3vl/runtime/runtime.hpp"

#include <mpi.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <chrono>
#include <fstream>

#ifdef Q3VL_CUDA
#include <cuda_runtime_api.h>
#endif

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/watchdog.hpp"

namespace q3vl {

namespace {

constexpr int kAbortGraceMs = 1000;
Runtime* g_runtime = nullptr;

std::string hostname() {
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  return h;
}
}  // namespace

Runtime& Runtime::init(int* argc, char*** argv) {
  if (g_runtime) return *g_runtime;
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  }
  // Errors come back as codes so that they become messages naming the collective.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  g_runtime = new Runtime();
  Runtime& rt = *g_runtime;
  Placement& p = rt.place_;
  MPI_Comm_rank(MPI_COMM_WORLD, &p.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p.size);
  p.host = hostname();
  rt.world_ = std::make_unique<MpiComm>(MPI_COMM_WORLD);

  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, p.rank, MPI_INFO_NULL, &node);
  rt.node_ = std::make_unique<MpiComm>(node, true);
  p.local_rank = rt.node_->rank();
  p.local_size = rt.node_->size();
  // Node index: number the node leaders (local rank 0) in world-rank order.
  int leader = p.local_rank == 0 ? 1 : 0;
  std::vector<int> leaders(p.size);
  MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int my_leader = p.rank;  // world rank of this node's local rank 0
  MPI_Bcast(&my_leader, 1, MPI_INT, 0, node);
  p.nodes = 0;
  for (int r = 0; r < p.size; ++r) {
    if (r == my_leader) p.node = p.nodes;
    p.nodes += leaders[r];
  }
#ifdef Q3VL_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
    p.gpus_visible = n;
    p.gpu = p.local_rank % n;
  }
#endif
  Log::get().set_rank(p.rank);
  return rt;
}

Runtime& Runtime::get() {
  Q3VL_CHECK(g_runtime, "Runtime::init was not called");
  return *g_runtime;
}

Deck Runtime::load_deck(const std::string& path, const std::vector<std::string>& overrides, const std::string& mode) {
  // Rank 0 alone reads the file; the others get either the resolved text or rank 0's error message.
  std::string text, given, error;
  if (place_.rank == 0) {
    try {
      const Deck d = Deck::load(path, overrides, mode);
      text = d.to_toml(), given = d.given_keys();
    } catch (const Error& e) {
      error = e.what();
    }
  }
  world_->broadcast_string(error, 0);
  if (!error.empty()) fail_all(error);
  world_->broadcast_string(text, 0);
  world_->broadcast_string(given, 0);
  Deck d = Deck::parse(text, path.empty() ? "<defaults>" : path, {}, "");
  d.set_given_keys(given);  // a default stays a default (model-directory settings may replace it)
  return d;
}

void Runtime::set_timeout(double seconds) {
  world_->set_timeout(seconds);
  node_->set_timeout(seconds);
  watchdog_start(MPI_COMM_WORLD, seconds);
}

std::string Runtime::timing_table() {
  Blocking guard("timing table (raw MPI gathers of the timers)");
  // Union of region names over ranks, so a region only some ranks entered still lines up.
  std::string mine;
  for (const auto& [name, t] : Timers::get().regions()) mine += name + '\n';
  int len = int(mine.size());
  std::vector<int> lens(place_.size), displs(place_.size);
  MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int i = 0; i < place_.size; ++i) displs[i] = total, total += lens[i];
  std::string all(size_t(total), '\0');
  MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, MPI_COMM_WORLD);
  std::set<std::string> names;
  std::istringstream in(all);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.insert(line);
  std::vector<double> t, tmin(names.size()), tmax(names.size()), tsum(names.size());
  for (const auto& n : names) {
    auto it = Timers::get().regions().find(n);
    t.push_back(it == Timers::get().regions().end() ? 0.0 : it->second);
  }
  if (names.empty()) return "";
  MPI_Reduce(t.data(), tmin.data(), int(t.size()), MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
  MPI_Reduce(t.data(), tmax.data(), int(t.size()), MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  MPI_Reduce(t.data(), tsum.data(), int(t.size()), MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
  std::ostringstream out;
  out << "\nTiming (seconds over " << place_.size << " rank" << (place_.size > 1 ? "s" : "") << ")\n"
      << std::left << std::setw(28) << "region" << std::right << std::setw(12) << "min" << std::setw(12) << "avg"
      << std::setw(12) << "max" << std::setw(10) << "%imbal" << "\n"
      << std::string(74, '-') << "\n";
  size_t i = 0;
  for (const auto& n : names) {
    double avg = tsum[i] / place_.size;
    double imbal = avg > 0 ? 100.0 * (tmax[i] - avg) / avg : 0.0;
    out << std::left << std::setw(28) << n << std::right << std::fixed << std::setprecision(4) << std::setw(12)
        << tmin[i] << std::setw(12) << avg << std::setw(12) << tmax[i] << std::setprecision(1) << std::setw(10)
        << imbal << "\n";
    ++i;
  }
  return out.str();
}

void Runtime::finalize() {
  watchdog_stop();
  node_.reset();
  world_.reset();
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}

void exit_collective(const std::string& msg) {
  int rank = 0, inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::fprintf(stderr, "q3vl: error: %s\n", msg.c_str());
  std::fflush(stderr);
  if (g_runtime) g_runtime->finalize();
  else if (inited) MPI_Finalize();
  std::exit(1);
}

void agree_or_fail(Comm& c, const std::string& err) {
  const int n = c.size();
  int64_t first = err.empty() ? n : c.rank();
  c.all_reduce(&first, 1, DType::I64, ReduceOp::Min);
  if (first == n) return;
  std::string msg = err;
  c.broadcast_string(msg, int(first));
  if (n > 1) {
    std::string host = c.rank() == int(first) ? hostname() : "";
    c.broadcast_string(host, int(first));
    msg = "rank " + std::to_string(c.world_rank(int(first))) + " (" + host + "): " + msg;
  }
  fail_all(msg);
}

int64_t available_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (f >> key >> kib)
    if (key == "MemAvailable:") return kib * 1024;
  return int64_t(sysconf(_SC_AVPHYS_PAGES)) * int64_t(sysconf(_SC_PAGE_SIZE));
}

void idle_barrier(Comm& c, const std::string& what) {
  const double t = c.timeout();
  c.set_timeout(0);
  {
    Blocking guard(what);
    c.barrier();
  }
  c.set_timeout(t);
}

void abort_local(const std::string& msg) {
  int rank = 0, size = 1, inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank), MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::fprintf(stderr, "q3vl: error on rank %d (%s): %s\n", rank, hostname().c_str(), msg.c_str());
  std::fflush(stderr);
  if (!inited || finalized) std::exit(1);
  if (size == 1) {
    // Nobody to take down: end as a collective error does, without MPICH's abort report.
    watchdog_stop();
    MPI_Finalize();
    std::exit(1);
  }
  // MPICH prints "Abort(1) on node N (rank R in comm 0): application called MPI_Abort..." from this process;
  // the message above already says what happened and where. (MPIR_CVAR_SUPPRESS_ABORT_MESSAGE only blanks the
  // text after the colon in MPICH 4.0: the "Abort(1) on node" line stays.)
  // Give mpiexec's proxy time to forward the line: MPI_Abort has it kill every rank and exit, and on a busy node
  // what still sits in the stderr pipe was lost (the job then ended without saying why).
  std::this_thread::sleep_for(std::chrono::milliseconds(kAbortGraceMs));
  if (int null = ::open("/dev/null", O_WRONLY); null >= 0) ::dup2(null, 2);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

}  // namespace q3vl
