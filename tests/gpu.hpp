// GPU tests: Q3VL_NEED_GPU() at the top of a test skips it where no GPU is visible, and fails it instead when
// Q3VL_REQUIRE_GPU=1 (make test-gpu sets it), so that a GPU run cannot pass by skipping.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#ifdef Q3VL_CUDA
#include <cuda_runtime_api.h>
#endif

namespace q3vl::test {

inline bool have_gpu() {
#ifdef Q3VL_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

inline bool gpu_required() {
  const char* v = std::getenv("Q3VL_REQUIRE_GPU");
  return v && !std::strcmp(v, "1");
}

inline const char* no_gpu_reason() {
#ifdef Q3VL_CUDA
  return "no GPU visible";
#else
  return "built without CUDA (no nvcc found, or CUDA=0)";
#endif
}

}  // namespace q3vl::test

// A macro: GTEST_SKIP and FAIL return from the test body itself.
#define Q3VL_NEED_GPU()                                                                  \
  do {                                                                                   \
    if (!::q3vl::test::have_gpu()) {                                                     \
      if (::q3vl::test::gpu_required())                                                  \
        FAIL() << ::q3vl::test::no_gpu_reason() << ", and Q3VL_REQUIRE_GPU=1 demands one"; \
      GTEST_SKIP() << ::q3vl::test::no_gpu_reason();                                     \
    }                                                                                    \
  } while (0)
