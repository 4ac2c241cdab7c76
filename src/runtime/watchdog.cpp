#include "q3vl/runtime/watchdog.hpp"

#include <signal.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/runtime/stop.hpp"

namespace q3vl {

namespace {

// CLOCK_MONOTONIC is one clock for every process of a node, so heartbeats compare across ranks.
int64_t now_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

constexpr auto kBeat = std::chrono::milliseconds(200);
// A rank that sees a silent peer but is not the lowest live rank of its node waits this long before it aborts
// too, so that one message is printed (the lowest rank's abort usually ends the job first).
constexpr int64_t kDefer = 2000000000;

struct State {
  std::unique_ptr<NodeSlots> beats;
  int rank = 0, size = 1;
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool quit = false;                // under mu
  std::string what;                 // under mu: the Blocking region
  int64_t since = 0;                // under mu: when it began (0: none)
  std::atomic<double> timeout{0};
};
State* g = nullptr;

struct Silent {
  int rank;
  double seconds;
};

std::vector<Silent> silent_ranks(int64_t older_than_ns) {
  std::vector<Silent> out;
  const int64_t now = now_ns();
  for (int r = 0; r < g->size; ++r) {
    int64_t beat = 0;
    if (r == g->rank || !g->beats->load(r, &beat) || beat <= 0) continue;
    if (now - beat > older_than_ns) out.push_back({r, double(now - beat) * 1e-9});
  }
  return out;
}

// "rank 2 for 5.1 s", "ranks 2 (5.1 s), 3 (5.0 s)".
std::string describe(const std::vector<Silent>& s) {
  char buf[64];
  if (s.size() == 1) {
    std::snprintf(buf, sizeof buf, "rank %d for %.1f s", s[0].rank, s[0].seconds);
    return buf;
  }
  std::string out;
  for (const Silent& x : s) {
    std::snprintf(buf, sizeof buf, "%d (%.1f s)", x.rank, x.seconds);
    out += (out.empty() ? "ranks " : ", ") + std::string(buf);
  }
  return out;
}

void run() {
  std::unique_lock<std::mutex> lk(g->mu);
  int64_t deadline = 0;  // this rank's deferred abort
  while (!g->quit) {
    g->beats->store(now_ns());
    // As in Comm::wait: once SIGTERM came, a silent rank is waited for at most Comm::kTermGrace.
    const double timeout = g->timeout.load();
    const bool term = stop_signal_pending() == SIGTERM;
    const double t = term && (timeout <= 0 || timeout > Comm::kTermGrace) ? Comm::kTermGrace : timeout;
    std::vector<Silent> s;
    if (g->since && t > 0) s = silent_ranks(int64_t(t * 1e9));
    if (s.empty()) {
      deadline = 0;
    } else {
      // The lowest rank of this node that is not silent reports; the others follow if the job lives on.
      int lowest = g->rank;
      for (int r = 0; r < g->rank; ++r) {
        int64_t beat = 0;
        bool quiet = false;
        for (const Silent& x : s) quiet |= x.rank == r;
        if (!quiet && g->beats->load(r, &beat)) {
          lowest = r;
          break;
        }
      }
      if (lowest != g->rank && !deadline) deadline = now_ns() + kDefer;
      if (lowest == g->rank || now_ns() > deadline) {
        char limit[96];
        if (t != timeout) std::snprintf(limit, sizeof limit, "%g s (SIGTERM received; runtime.timeout = %g s)", t, timeout);
        else std::snprintf(limit, sizeof limit, "runtime.timeout = %g s", t);
        const std::string msg = "watchdog: " + g->what + Comm::where() + " cannot finish: no sign of life from " +
                                describe(s) + ", longer than " + limit + " (stopped or dead); ending the job";
        lk.unlock();
        abort_local(msg);  // MPI_Abort from this thread: the main thread is blocked inside MPI
      }
    }
    g->cv.wait_for(lk, kBeat);
  }
}

}  // namespace

void watchdog_start(MPI_Comm world, double timeout) {
  if (g) {
    g->timeout = timeout;
    return;
  }
  g = new State();
  MPI_Comm_rank(world, &g->rank);
  MPI_Comm_size(world, &g->size);
  g->beats = std::make_unique<NodeSlots>(world);
  g->beats->store(now_ns());
  g->timeout = timeout;
  g->thread = std::thread(run);
}

void watchdog_set_timeout(double timeout) {
  if (g) g->timeout = timeout;
}

void watchdog_stop() {
  if (!g) return;
  {
    std::lock_guard<std::mutex> lk(g->mu);
    g->quit = true;
  }
  g->cv.notify_all();
  g->thread.join();
  delete g;  // frees the window: collective, and every rank stops here (Runtime::finalize)
  g = nullptr;
}

std::string watchdog_silent(double seconds) {
  if (!g) return "";
  return describe(silent_ranks(int64_t(seconds * 1e9)));
}

Blocking::Blocking(const std::string& what) {
  if (!g) return;
  std::lock_guard<std::mutex> lk(g->mu);
  g->what = what;
  g->since = now_ns();
}

Blocking::~Blocking() {
  if (!g) return;
  std::lock_guard<std::mutex> lk(g->mu);
  g->since = 0;
}

}  // namespace q3vl
