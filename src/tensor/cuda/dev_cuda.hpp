// The CUDA side of the device op layer: the launchers behind q3vl::dev's ops when Exec::device is CUDA. The public
// ops (src/tensor/dev_cpu.cpp) forward here; each launcher enqueues on the Exec's stream and never synchronises.
#pragma once
#include "q3vl/tensor/dev.hpp"

namespace q3vl::dev::cuda {

int device_count();
Exec make_exec(size_t ws_bytes, int gpu);
void destroy_exec(Exec& x);
void synchronize(const Exec& x);
void bind_thread(const Exec& x);
void* alloc(const Exec& x, size_t bytes);
void release(const Exec& x, void* p);
void to_device(const Exec& x, void* dst, const void* src, size_t bytes);
void to_host(const Exec& x, void* dst, const void* src, size_t bytes);
void copy(const Exec& x, void* dst, const void* src, size_t bytes);
void memory_info(const Exec& x, size_t* free_bytes, size_t* total_bytes);
bool capture_begin(const Exec& x);
void* capture_end(const Exec& x);
void graph_launch(const Exec& x, void* g);
void graph_destroy(void* g);
void* event_create(const Exec& x);
void event_destroy(void* e);
void event_record(const Exec& x, void* e);
void event_wait(const Exec& x, void* e);
void event_synchronize(void* e);
void* timing_event_create(const Exec& x);
float event_elapsed_ms(void* a, void* b);

#include "q3vl/tensor/dev_ops.inc"

// dev::linear_chain's persistent kernel (q8.cu) where it takes every link; false: nothing launched.
bool linear_chain_kernel(const Exec& x, const ChainLink* links, int count, int64_t N, QFormat qf, DType dt);

}  // namespace q3vl::dev::cuda
