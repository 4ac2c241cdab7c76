// Logging: rank 0 prints to stdout; with run.rank_logs every rank also writes out_dir/rank-N.log.
// Timers accumulate wall time per named region; runtime/ reduces them over ranks into the exit table.
#pragma once
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

namespace q3vl {

class Log {
 public:
  static Log& get();
  void set_rank(int rank) { rank_ = rank; }
  int rank() const { return rank_; }
  // Open out_dir/rank-N.log for this rank (creates out_dir).
  void open_rank_file(const std::string& out_dir);
  // Rank 0 to stdout (and every rank to its file).
  void info(const std::string& msg);
  // Every rank to its file only.
  void rank_info(const std::string& msg);
  // To stderr from any rank, prefixed with the rank.
  void warn(const std::string& msg);
  ~Log();

 private:
  int rank_ = 0;
  std::FILE* file_ = nullptr;
};

inline void log_info(const std::string& msg) { Log::get().info(msg); }
// A size for people: "12.34 MiB" below a GiB, else "1.23 GiB".
inline std::string bytes_text(double bytes) {
  char b[48];
  const bool g = bytes >= 1073741824.0;
  std::snprintf(b, sizeof b, "%.2f %s", bytes / (g ? 1073741824.0 : 1048576.0), g ? "GiB" : "MiB");
  return b;
}
inline void log_warn(const std::string& msg) { Log::get().warn(msg); }

class Timers {
 public:
  static Timers& get();
  void add(const std::string& region, double seconds) { acc_[region] += seconds; }
  const std::map<std::string, double>& regions() const { return acc_; }
  void clear() { acc_.clear(); }

 private:
  std::map<std::string, double> acc_;
};

// Times a scope into Timers under `region`.
class ScopedTimer {
 public:
  explicit ScopedTimer(std::string region) : region_(std::move(region)), t0_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    Timers::get().add(region_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
  }

 private:
  std::string region_;
  std::chrono::steady_clock::time_point t0_;
};

double wall_seconds();  // monotonic, for rates and ETAs

}  // namespace q3vl
