#include "q3vl/core/log.hpp"

#include <filesystem>

#include "q3vl/core/error.hpp"

namespace q3vl {

Log& Log::get() {
  static Log log;
  return log;
}

Log::~Log() {
  if (file_) std::fclose(file_);
}

void Log::open_rank_file(const std::string& out_dir) {
  std::filesystem::create_directories(out_dir);
  std::string path = out_dir + "/rank-" + std::to_string(rank_) + ".log";
  if (file_) std::fclose(file_);
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) fail("cannot open rank log '" + path + "' for writing");
}

void Log::info(const std::string& msg) {
  if (rank_ == 0) {
    std::fputs(msg.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  rank_info(msg);
}

void Log::rank_info(const std::string& msg) {
  if (!file_) return;
  std::fputs(msg.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

void Log::warn(const std::string& msg) {
  std::fprintf(stderr, "[rank %d] warning: %s\n", rank_, msg.c_str());
  rank_info("warning: " + msg);
}

Timers& Timers::get() {
  static Timers t;
  return t;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace q3vl
