#include "q3vl/runtime/check.hpp"

#include <sys/statvfs.h>
#include <sys/sysinfo.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#ifdef Q3VL_CUDA
#include <cuda_runtime_api.h>
#endif

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/core/thread_pool.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/tensor/dev_host.hpp"

namespace q3vl {

namespace {

// One rank's report, fixed-size so it can be gathered in one call.
struct RankInfo {
  char host[64];
  char device[64];
  int local_rank, local_size, gpu, gpus_visible;
  double host_mem_gb, gpu_mem_gb, disk_free_gb;
  int driver_version, runtime_version;
  char write_error[96];  // why a file cannot be created in out_dir; empty when it can
};

// Root ignores permission bits, so only writing a file tells whether out_dir takes files.
void probe_write(const std::string& dir, int rank, char* error, size_t n) {
  std::string path = dir + "/.q3vl_check_rank" + std::to_string(rank);
  errno = 0;
  bool ok = static_cast<bool>(std::ofstream(path) << "ok\n");
  if (!ok) std::snprintf(error, n, "%s", errno ? std::strerror(errno) : "write failed");
  std::remove(path.c_str());
}

RankInfo probe(const Deck& deck) {
  const Placement& p = Runtime::get().where();
  RankInfo r{};
  std::snprintf(r.host, sizeof r.host, "%s", p.host.c_str());
  std::snprintf(r.device, sizeof r.device, "cpu");
  r.local_rank = p.local_rank;
  r.local_size = p.local_size;
  r.gpu = p.gpu;
  r.gpus_visible = p.gpus_visible;
  struct sysinfo si {};
  if (sysinfo(&si) == 0) r.host_mem_gb = double(si.totalram) * si.mem_unit / 1e9;
  std::error_code ec;
  std::filesystem::create_directories(deck.str("run.out_dir"), ec);
  struct statvfs sv {};
  if (statvfs(deck.str("run.out_dir").c_str(), &sv) == 0) r.disk_free_gb = double(sv.f_bavail) * sv.f_frsize / 1e9;
  else r.disk_free_gb = -1;
  probe_write(deck.str("run.out_dir"), p.rank, r.write_error, sizeof r.write_error);
#ifdef Q3VL_CUDA
  if (p.gpu >= 0) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, p.gpu) == cudaSuccess) {
      std::snprintf(r.device, sizeof r.device, "gpu%d %.48s", p.gpu, prop.name);  // a name cut to the record
      r.gpu_mem_gb = double(prop.totalGlobalMem) / 1e9;
    }
    cudaDriverGetVersion(&r.driver_version);
    cudaRuntimeGetVersion(&r.runtime_version);
  }
#endif
  return r;
}

constexpr int64_t kRateElems = int64_t(16) << 20;  // the host AdamW's elements a rank: 4 x 64 MiB of fp32

std::string fmt_gbs(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GB/s", v);
  return b;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What one rank measured of the rates `q3vl plan` predicts an offloaded step from (plan.host_gbs, plan.pcie_gbs).
struct Rates {
  double host_gbs = 0, host_s = 0, up = 0, down = 0;  // the node's host AdamW GB/s; this GPU's copies, GB/s
  int threads = 0;
};

// Measured as train uses the node: every rank of the node at once, the host AdamW on each rank's cores (ThreadPool,
// as parallel.offload_optimizer = "cpu" runs it; 28 bytes of fp32 traffic an element), and on GPU ranks pinned copies
// of 256 MiB each way.
Rates offload_rates(const Deck& deck) {
  Runtime& rt = Runtime::get();
  Comm& node = rt.node_comm();
  const Placement& p = rt.where();
  Rates r;
  const int64_t n = kRateElems;
  std::vector<float> w(size_t(n), 0.5f), g(size_t(n), 1e-3f), m(size_t(n), 0.f), v(size_t(n), 0.f);
  ThreadPool pool(rank_cores(p.local_size), true);
  r.threads = pool.size();
  const dev::Exec cpu{};
  auto adam = [&](int64_t t) {
    pool.run(n, [&](int64_t lo, int64_t hi) {
      dev::adamw(cpu, w.data() + lo, g.data() + lo, m.data() + lo, v.data() + lo, hi - lo, 0.9, 0.999, 1e-8, 1e-5,
                 0.1, 1.0, t);
    });
  };
  adam(1);  // pages touched
  node.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 2; t < 5; ++t) adam(t);
  r.host_s = node.max(seconds_since(t0)) / 3;
  r.host_gbs = 28.0 * double(n) * p.local_size / r.host_s / 1e9;
  if (deck.str("model.backend") != "cuda" || p.gpu < 0) return r;
  const size_t bytes = size_t(256) << 20;
  dev::Exec x = dev::make_exec(Device::CUDA, 0, p.gpu);
  void *h = dev::host_alloc(x, bytes), *d = dev::alloc(x, bytes);
  auto rate = [&](bool up) {
    auto copy = [&] { up ? dev::to_device(x, d, h, bytes) : dev::to_host(x, h, d, bytes), dev::synchronize(x); };
    copy();
    node.barrier();
    const auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4; ++i) copy();
    return double(bytes) * 4 / node.max(seconds_since(t1)) / 1e9;
  };
  r.up = rate(true), r.down = rate(false);
  dev::host_release(x, h), dev::release(x, d), dev::destroy_exec(x);
  return r;
}

// A line per node (its first rank's figures; the copies: its slowest GPU's).
void report_rates(Comm& world, const Rates& mine) {
  const Placement& p = Runtime::get().where();
  std::vector<Rates> all(size_t(world.size()));
  std::vector<int> local(size_t(world.size())), nodes(size_t(world.size()));
  world.all_gather(&mine, all.data(), sizeof(Rates), DType::U8);
  world.all_gather(&p.local_rank, local.data(), 1, DType::I32);
  world.all_gather(&p.node, nodes.data(), 1, DType::I32);
  for (int r = 0; r < world.size(); ++r) {
    if (local[size_t(r)] != 0) continue;
    const Rates& a = all[size_t(r)];
    double up = 0, down = 0;
    for (int q = 0; q < world.size(); ++q)
      if (nodes[size_t(q)] == nodes[size_t(r)] && all[size_t(q)].up > 0)
        up = up > 0 ? std::min(up, all[size_t(q)].up) : all[size_t(q)].up,
        down = down > 0 ? std::min(down, all[size_t(q)].down) : all[size_t(q)].down;
    char line[400];
    std::snprintf(line, sizeof line,
                  "offload rates, node of rank %d: host AdamW %.1f GB/s (its ranks at once, %d thread(s) a rank, %.3f "
                  "s for %lld elements a rank)%s; for q3vl plan: plan.host_gbs = %.0f",
                  r, a.host_gbs, a.threads, a.host_s, (long long)kRateElems,
                  up > 0 ? (", pinned copies per GPU " + fmt_gbs(up) + " up, " + fmt_gbs(down) + " down").c_str()
                         : " (model.backend = cpu: no GPU copies)",
                  a.host_gbs);
    log_info(std::string(line) + (up > 0 ? ", plan.pcie_gbs = " + std::to_string(int(std::min(up, down))) : ""));
  }
}

}  // namespace

int run_check(const Deck& deck) {
  Runtime& rt = Runtime::get();
  Comm& world = rt.world();
  const int n = world.size();
  RankInfo mine = probe(deck);
  std::vector<RankInfo> all(static_cast<size_t>(n));
  // Test hook for the watchdog: one rank arrives late at the first collective.
  if (world.rank() == deck.integer("runtime.debug_sleep_rank"))
    std::this_thread::sleep_for(std::chrono::duration<double>(deck.real("runtime.debug_sleep_seconds")));
  world.all_gather(&mine, all.data(), sizeof(RankInfo), DType::U8);

  std::ostringstream t;
  t << "rank  host                 local  device                         host GB   GPU GB  disk free GB\n";
  for (int r = 0; r < n; ++r) {
    char line[256];
    std::snprintf(line, sizeof line, "%4d  %-20s %5d  %-28s %9.1f %8.1f %13.1f\n", r, all[r].host,
                  all[r].local_rank, all[r].device, all[r].host_mem_gb, all[r].gpu_mem_gb, all[r].disk_free_gb);
    t << line;
  }
  log_info(t.str());

  // Every rank must have what the deck asks for; name the first that does not.
  std::string problems;
  const int64_t gpus_per_node = deck.integer("runtime.gpus_per_node");
  for (int r = 0; r < n; ++r) {
    if (deck.str("model.backend") == "cuda" && all[r].gpu < 0)
      problems += "  rank " + std::to_string(r) + " on " + all[r].host + ": no GPU visible (model.backend = cuda)\n";
    // A node's count, said once by its first rank.
    if (all[r].local_rank == 0 && all[r].gpus_visible < gpus_per_node) {
      const int others = all[r].local_size - 1;
      problems += "  rank " + std::to_string(r) + " on " + all[r].host +
                  (others ? " (and its " + std::to_string(others) + " other rank(s) there)" : "") + ": " +
                  std::to_string(all[r].gpus_visible) + " GPU(s) visible, runtime.gpus_per_node = " +
                  std::to_string(gpus_per_node) + "\n";
    }
    if (all[r].disk_free_gb >= 0 && all[r].disk_free_gb < 1.0)
      problems += "  rank " + std::to_string(r) + " on " + all[r].host + ": less than 1 GB free in " +
                  deck.str("run.out_dir") + "\n";
    if (all[r].disk_free_gb < 0)
      problems += "  rank " + std::to_string(r) + " on " + all[r].host + ": cannot stat output directory " +
                  deck.str("run.out_dir") + "\n";
    else if (all[r].write_error[0])
      problems += "  rank " + std::to_string(r) + " on " + all[r].host + ": cannot write to output directory " +
                  deck.str("run.out_dir") + ": " + all[r].write_error + "\n";
  }
  if (!problems.empty()) fail_all("check failed:\n" + problems);

  // All-reduce bandwidth (fp32 sum), nccl-tests conventions: busbw = algbw * 2(n-1)/n.
  log_info("all-reduce over " + std::to_string(n) + " rank(s), " + world.kind() + ":");
  log_info("        bytes     time(us)   algbw(GB/s)   busbw(GB/s)");
  for (size_t bytes : {size_t(1) << 12, size_t(1) << 16, size_t(1) << 20, size_t(1) << 24}) {
    ScopedTimer timer("check: all-reduce");
    std::vector<float> buf(bytes / 4, 1.0f);
    world.all_reduce(buf.data(), buf.size(), DType::F32);  // warm-up
    if (buf[0] != float(n)) fail("check: all-reduce gave " + std::to_string(buf[0]) + ", expected " + std::to_string(n));
    const int iters = bytes >= (size_t(1) << 24) ? 3 : 10;
    world.barrier();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) world.all_reduce(buf.data(), buf.size(), DType::F32);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    dt = world.max(dt);
    double algbw = double(bytes) / dt / 1e9;
    char line[160];
    std::snprintf(line, sizeof line, "%13zu %12.1f %13.3f %13.3f", bytes, dt * 1e6, algbw,
                  n > 1 ? algbw * 2.0 * (n - 1) / n : 0.0);
    log_info(line);
  }
  report_rates(world, offload_rates(deck));
  log_info("check passed: " + std::to_string(n) + " rank(s) on " + std::to_string(rt.where().nodes) + " node(s)");
  return 0;
}

}  // namespace q3vl
