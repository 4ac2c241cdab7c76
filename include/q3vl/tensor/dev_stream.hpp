// Stream priorities. The GPU schedules waiting blocks of a higher-priority stream's kernels before those of lower
// ones whenever an SM has room (running blocks are not preempted), so work on a default-priority stream (DevZero's
// overlapped optimizer update) takes what the trainer's compute and communication leave of the GPU.
#pragma once
#include <cstddef>

#include "q3vl/tensor/dev.hpp"

namespace q3vl::dev {

// As make_exec, with its stream at the device's highest priority (make_exec's: the default, the lowest). The CPU: as
// make_exec.
Exec make_priority_exec(Device d, size_t ws_bytes, int gpu);

#ifdef Q3VL_CUDA
namespace cuda {
Exec make_priority_exec(size_t ws_bytes, int gpu);
}  // namespace cuda
#endif

}  // namespace q3vl::dev
