// The CUDA Exec: a non-blocking stream, a cuBLASLt handle and a workspace on the current device; memory and copies.
// The only place that allocates, frees or synchronises (ops never do).
#include <cstring>

#include "q3vl/tensor/dev_host.hpp"
#include "q3vl/tensor/dev_stream.hpp"
#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;  // no driver or no device: none
}

namespace {
Exec exec_at(size_t ws_bytes, int gpu, bool high) {
  Q3VL_CU(cudaSetDevice(gpu));
  Exec x;
  x.device = Device::CUDA;
  cudaStream_t s = nullptr;
  int least = 0, greatest = 0;
  Q3VL_CU(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  Q3VL_CU(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high ? greatest : least));
  x.stream = s;
  cublasLtHandle_t h = nullptr;
  Q3VL_CUBLAS(cublasLtCreate(&h));
  x.blas = h;
  if (ws_bytes) Q3VL_CU(cudaMalloc(&x.ws, ws_bytes));
  x.ws_bytes = ws_bytes;
  x.gpu = gpu;
  return x;
}
}  // namespace

Exec make_exec(size_t ws_bytes, int gpu) { return exec_at(ws_bytes, gpu, false); }
Exec make_priority_exec(size_t ws_bytes, int gpu) { return exec_at(ws_bytes, gpu, true); }

void destroy_exec(Exec& x) {
  if (x.stream) Q3VL_CU(cudaStreamSynchronize(stream_of(x)));  // pending work may still use ws
  if (x.ws) Q3VL_CU(cudaFree(x.ws));
  if (x.blas) Q3VL_CUBLAS(cublasLtDestroy(static_cast<cublasLtHandle_t>(x.blas)));
  if (x.stream) Q3VL_CU(cudaStreamDestroy(stream_of(x)));
  x = Exec{};
}

void synchronize(const Exec& x) { Q3VL_CU(cudaStreamSynchronize(stream_of(x))); }

void bind_thread(const Exec& x) { Q3VL_CU(cudaSetDevice(x.gpu)); }

void* alloc(const Exec& x, size_t bytes) {
  void* p = nullptr;
  Q3VL_CU(cudaMalloc(&p, bytes ? bytes : 1));  // a valid pointer even for empty buffers, as the CPU side
  return p;
}

void release(const Exec& x, void* p) {
  if (p) Q3VL_CU(cudaFree(p));  // cudaFree synchronises the device: fine outside a step
}

void to_device(const Exec& x, void* dst, const void* src, size_t bytes) {
  if (bytes) Q3VL_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(x)));
}

void to_host(const Exec& x, void* dst, const void* src, size_t bytes) {
  if (bytes) Q3VL_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(x)));
  Q3VL_CU(cudaStreamSynchronize(stream_of(x)));  // the caller reads dst next
}

void copy(const Exec& x, void* dst, const void* src, size_t bytes) {
  if (bytes && dst != src) Q3VL_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(x)));
}

void* host_alloc(size_t bytes) {
  void* p = nullptr;
  Q3VL_CU(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable));  // page-locked: copies run asynchronously
  std::memset(p, 0, bytes);
  return p;
}

void host_release(void* p) {
  if (p) Q3VL_CU(cudaFreeHost(p));
}

void host_register(void* p, size_t bytes) {
  if (p && bytes) Q3VL_CU(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
}

void host_unregister(void* p) {
  if (p) Q3VL_CU(cudaHostUnregister(p));
}

void to_host_async(const Exec& x, void* dst, const void* src, size_t bytes) {
  if (bytes) Q3VL_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(x)));
}

void memory_info(const Exec& x, size_t* free_bytes, size_t* total_bytes) {
  Q3VL_CU(cudaMemGetInfo(free_bytes, total_bytes));
}

// Thread-local capture: another thread's CUDA calls (serve's HTTP side, an NCCL proxy) neither join nor break it.
bool capture_begin(const Exec& x) {
  Q3VL_CU(cudaStreamBeginCapture(stream_of(x), cudaStreamCaptureModeThreadLocal));
  return true;
}

void* capture_end(const Exec& x) {
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(stream_of(x), &g);
  if (e != cudaSuccess || !g) {  // an op that cannot be recorded invalidated the capture: the caller runs eagerly
    (void)cudaGetLastError();
    if (g) cudaGraphDestroy(g);
    return nullptr;
  }
  cudaGraphExec_t ge = nullptr;
  const cudaError_t i = cudaGraphInstantiate(&ge, g, 0);
  Q3VL_CU(cudaGraphDestroy(g));
  if (i != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return ge;
}

void graph_launch(const Exec& x, void* g) { Q3VL_CU(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g), stream_of(x))); }

void graph_destroy(void* g) {
  if (g) Q3VL_CU(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g)));
}

void* event_create(const Exec& x) {
  cudaEvent_t e = nullptr;
  Q3VL_CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void event_destroy(void* e) {
  if (e) Q3VL_CU(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
}

void event_record(const Exec& x, void* e) { Q3VL_CU(cudaEventRecord(static_cast<cudaEvent_t>(e), stream_of(x))); }

void event_wait(const Exec& x, void* e) { Q3VL_CU(cudaStreamWaitEvent(stream_of(x), static_cast<cudaEvent_t>(e), 0)); }

void event_synchronize(void* e) { Q3VL_CU(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); }

void* timing_event_create(const Exec& x) {
  cudaEvent_t e = nullptr;
  Q3VL_CU(cudaEventCreate(&e));
  return e;
}

float event_elapsed_ms(void* a, void* b) {
  Q3VL_CU(cudaEventSynchronize(static_cast<cudaEvent_t>(b)));
  float ms = 0;
  Q3VL_CU(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)));
  return ms;
}

}  // namespace q3vl::dev::cuda
