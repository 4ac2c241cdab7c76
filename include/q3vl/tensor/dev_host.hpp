// Host memory the device reads and writes asynchronously (optimizer offload, parameters kept on the host): pinned
// (page-locked) on CUDA, so that copies on a stream overlap compute; plain aligned memory on the CPU backend, where
// "device" memory is host memory too. Like dev::alloc, used when buffers are sized, never inside a step.
#pragma once
#include <cstddef>

#include "q3vl/tensor/dev.hpp"

namespace q3vl::dev {

// Zeroed host memory for x's device (64-byte aligned). A refusal (no pinned memory left, a locked-memory limit)
// fails with the runtime's status string.
void* host_alloc(const Exec& x, size_t bytes);
void host_release(const Exec& x, void* p);
// Pins (page-locks) host memory allocated elsewhere for x's device, in place, until host_unregister; nothing on the
// CPU backend.
void host_register(const Exec& x, void* p, size_t bytes);
void host_unregister(const Exec& x, void* p);
// A copy device -> host enqueued on x's stream that the host does not wait for (to_host does): the caller orders
// it with an event or synchronize() before it reads dst.
void to_host_async(const Exec& x, void* dst, const void* src, size_t bytes);

#ifdef Q3VL_CUDA
namespace cuda {
void* host_alloc(size_t bytes);
void host_release(void* p);
void host_register(void* p, size_t bytes);
void host_unregister(void* p);
void to_host_async(const Exec& x, void* dst, const void* src, size_t bytes);
}  // namespace cuda
#endif

}  // namespace q3vl::dev
