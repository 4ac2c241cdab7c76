// One-off host work spread over the node's cores (weight init and quantization at load, not steps).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace q3vl {

// f(i) for i in [0, n), items taken in turn by up to hardware_concurrency threads (the caller's among them). The
// first exception thrown stops new items and is rethrown here.
template <class F>
void parallel_for(int64_t n, F&& f) {
  std::atomic<int64_t> next{0};
  std::exception_ptr err;
  std::mutex m;
  auto work = [&] {
    for (int64_t i; (i = next++) < n;) try {
        f(i);
      } catch (...) {
        std::lock_guard<std::mutex> g(m);
        if (!err) err = std::current_exception();
        next = n;
      }
  };
  const int64_t t = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n);
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < t; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace q3vl
