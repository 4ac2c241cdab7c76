#include "q3vl/core/thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

namespace q3vl {

namespace {
std::vector<int> affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}
}  // namespace

int rank_cores(int ranks_on_node) {
  const int mask = int(affinity_cpus().size()), node = int(std::thread::hardware_concurrency());
  if (mask <= 0) return 1;
  // A mask smaller than the node is a binding: the rank's own cores. The whole node: its share of it.
  return std::max(1, mask < node ? mask : mask / std::max(1, ranks_on_node));
}

ThreadPool::ThreadPool(int threads, bool pin) {
  std::vector<int> cpus = pin ? affinity_cpus() : std::vector<int>{};
  if (int(cpus.size()) >= int(std::thread::hardware_concurrency())) cpus.clear();  // not bound: leave it to the OS
  for (int i = 1; i < std::max(1, threads); ++i) {
    workers_.emplace_back([this, i] { work(i); });
    if (i < int(cpus.size())) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[size_t(i)], &one);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof one, &one);  // best effort
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(m_);
    stop_ = true;
  }
  go_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::range(int i) {
  const int64_t per = (n_ + size() - 1) / size(), chunk = (per + align_ - 1) / align_ * align_;
  const int64_t lo = std::min(n_, chunk * i), hi = std::min(n_, lo + chunk);
  if (lo < hi) (*f_)(lo, hi);
}

void ThreadPool::work(int i) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> g(m_);
      go_.wait(g, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
    }
    std::exception_ptr e;
    try {
      range(i);
    } catch (...) {
      e = std::current_exception();
    }
    std::lock_guard<std::mutex> g(m_);
    if (e && !err_) err_ = e;
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::run(int64_t n, const std::function<void(int64_t, int64_t)>& f, int64_t align) {
  {
    std::lock_guard<std::mutex> g(m_);
    f_ = &f, n_ = n, align_ = std::max<int64_t>(1, align), err_ = nullptr;
    pending_ = int(workers_.size());
    ++gen_;
  }
  go_.notify_all();
  std::exception_ptr mine;
  try {
    range(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> g(m_);
  done_.wait(g, [&] { return pending_ == 0; });
  if (mine) std::rethrow_exception(mine);
  if (err_) std::rethrow_exception(err_);
}

}  // namespace q3vl
