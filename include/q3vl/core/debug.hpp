// Test hook (runtime.debug_stop_rank/_step/_phase): one rank stops itself with SIGSTOP when it reaches a phase of
// a step, as a process that hangs or is suspended would, so that the fault suite (tests/cli/test_faults.sh) hits
// forward, backward and a checkpoint write at a known point. The phases are where debug_stop_point() is called:
// "forward" and "backward" at a pass's first unit use (model/dev_model.cpp), "checkpoint" after the first tensor
// of a checkpoint write (io/checkpoint.cpp).
#pragma once
#include <string>

namespace q3vl {

void debug_stop_arm(int rank, long step, const std::string& phase);  // rank < 0: off
void debug_stop_step(long step);                                       // the step being run
void debug_stop_point(const char* phase);                              // stops here if armed for it

// Test hook (environment Q3VL_DEBUG_PIN_LIMIT_MIB): pinned host allocations above that many MiB are refused, as a
// node's memlock limit or the driver refuses them, so that the offload's message for it can be tested anywhere.
// Throws Error as the refusal would; nothing when the variable is unset.
void debug_pin_check(size_t bytes);

}  // namespace q3vl
