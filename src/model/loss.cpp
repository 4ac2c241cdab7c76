// LM head + causal-LM cross-entropy (spec 4.9, 5.1), chunked over rows: only a chunk of logits exists at a time
// and the backward recomputes them instead of keeping [N, V].
#include <algorithm>
#include <vector>

#include "q3vl/model/layers.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

static constexpr int64_t kHeadChunk = 128;

template <class T>
double lm_head_loss_fwd(const T* h, const T* W, const int64_t* target, int64_t N, int64_t H, int64_t V,
                        T* logits_out) {
  std::vector<T> lg(std::min(N, kHeadChunk) * V);
  double total = 0;
  for (int64_t i0 = 0; i0 < N; i0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, N - i0);
    T* L = logits_out ? logits_out + i0 * V : lg.data();
    ops::linear_fwd(h + i0 * H, W, (const T*)nullptr, L, n, H, V);
    total += ops::cross_entropy(L, target + i0, (T*)nullptr, (T*)nullptr, n, V, T(0));
  }
  return total;
}

template <class T>
void lm_head_loss_bwd(const T* h, const T* W, const int64_t* target, int64_t N, int64_t H, int64_t V, T scale, T* dh,
                      T* dW) {
  std::vector<T> lg(std::min(N, kHeadChunk) * V), dl(lg.size());
  for (int64_t i0 = 0; i0 < N; i0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, N - i0);
    if (std::all_of(target + i0, target + i0 + n, [](int64_t t) { return t == -100; })) continue;
    ops::linear_fwd(h + i0 * H, W, (const T*)nullptr, lg.data(), n, H, V);
    std::fill(dl.begin(), dl.begin() + n * V, T(0));
    ops::cross_entropy(lg.data(), target + i0, (T*)nullptr, dl.data(), n, V, scale);
    ops::linear_bwd(dl.data(), h + i0 * H, W, dh + i0 * H, dW, (T*)nullptr, n, H, V);
  }
}

#define Q3VL_INST(T)                                                                                            \
  template double lm_head_loss_fwd<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, T*);      \
  template void lm_head_loss_bwd<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, T, T*, T*);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
