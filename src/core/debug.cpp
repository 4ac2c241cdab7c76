#include "q3vl/core/debug.hpp"

#include <signal.h>

#include <cstdlib>

#include "q3vl/core/error.hpp"

#include "q3vl/core/log.hpp"

namespace q3vl {

namespace {
int g_rank = -1;
long g_step = -1, g_now = -1;
std::string g_phase;
}  // namespace

void debug_stop_arm(int rank, long step, const std::string& phase) {
  g_rank = rank;
  g_step = step;
  g_phase = phase;
}

void debug_stop_step(long step) { g_now = step; }

void debug_stop_point(const char* phase) {
  if (g_rank < 0 || g_rank != Log::get().rank() || g_now != g_step || g_phase != phase) return;
  g_rank = -1;  // once: after SIGCONT the run goes on
  log_warn("runtime.debug_stop: stopping myself (SIGSTOP) in " + g_phase + " at step " + std::to_string(g_now));
  raise(SIGSTOP);
}

void debug_pin_check(size_t bytes) {
  static const char* limit = std::getenv("Q3VL_DEBUG_PIN_LIMIT_MIB");
  if (limit && double(bytes) > std::atof(limit) * double(1 << 20))
    fail("Q3VL_DEBUG_PIN_LIMIT_MIB = " + std::string(limit) + ": pinned host memory refused (a test hook)");
}

}  // namespace q3vl
