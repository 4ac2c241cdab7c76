// GPU tests skip where no GPU is visible, and fail instead under Q3VL_REQUIRE_GPU=1 (make test-gpu), so that a GPU
// run cannot pass by skipping.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#ifdef Q3VL_CUDA
#include <cuda_runtime_api.h>
#endif

namespace q3vl::test {
inline bool gpu_available() {
#ifdef Q3VL_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}
inline bool gpu_required() {
  const char* r = std::getenv("Q3VL_REQUIRE_GPU");
  return r && std::strcmp(r, "1") == 0;
}
}  // namespace q3vl::test

#define Q3VL_NEED_GPU()                                                                               \
  do {                                                                                                \
    if (!::q3vl::test::gpu_available()) {                                                             \
      if (::q3vl::test::gpu_required()) FAIL() << "Q3VL_REQUIRE_GPU=1 but no GPU is visible";         \
      GTEST_SKIP() << "no GPU here";                                                                  \
    }                                                                                                 \
  } while (0)
