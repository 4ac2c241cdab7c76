// Persistent host threads for work inside a step (the offloaded optimizer): made once at start-up, so a step starts
// no thread; each run() splits [0, n) into one contiguous range per thread (the caller's among them).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace q3vl {

// Cores this rank may use: its CPU affinity mask (what Slurm's or mpiexec's binding left it), shared with the other
// ranks of the node when the mask is the whole node (no binding). At least 1.
int rank_cores(int ranks_on_node);

class ThreadPool {
 public:
  // `threads` workers in all, the caller counted (>= 1). With `pin` and a rank bound to some of the node's cores
  // (Slurm, mpiexec -bind-to), worker i is bound to the i-th CPU of the rank's mask: its cores, its NUMA node.
  explicit ThreadPool(int threads, bool pin = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  int size() const { return int(workers_.size()) + 1; }
  // f(lo, hi) over [0, n) in size() contiguous ranges, their bounds multiples of `align`; returns when all are done.
  // The first exception thrown is rethrown here.
  void run(int64_t n, const std::function<void(int64_t, int64_t)>& f, int64_t align = 64);

 private:
  void work(int i);
  void range(int i);
  std::vector<std::thread> workers_;
  std::mutex m_;
  std::condition_variable go_, done_;
  const std::function<void(int64_t, int64_t)>* f_ = nullptr;
  int64_t n_ = 0, align_ = 1;
  uint64_t gen_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr err_;
};

}  // namespace q3vl
