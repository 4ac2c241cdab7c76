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

// Leaves k of the device's SMs to a stream of their own (the update in the backward: DevZero, Exec::sms): from this
// call on, the kernels whose grids are sized by the SM count (cuBLASLt's plans, through their SM count target; the
// grouped expert GEMM's persistent grid) take k fewer, so that theirs and that stream's blocks run side by side
// instead of the persistent blocks waiting for SMs. 0: all. The CPU: nothing.
void reserve_sms(Device d, int k);

#ifdef Q3VL_CUDA
namespace cuda {
Exec make_priority_exec(size_t ws_bytes, int gpu);
void reserve_sms(int k);
}  // namespace cuda
#endif

}  // namespace q3vl::dev
