// LM head + causal-LM cross-entropy (spec 4.9, 5.1), chunked over rows: only a chunk of logits exists at a time
// and the backward recomputes them instead of keeping [N, V]. Rows without a target skip the head (in training most
// rows are prompt or image tokens) unless the caller wants every row's logits.
#include <algorithm>
#include <cmath>
#include <vector>

#include "q3vl/model/layers.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

static constexpr int64_t kHeadChunk = 128;

// Rows that have a target: the others contribute nothing to the loss or its gradient.
static std::vector<int64_t> supervised_rows(const int64_t* target, int64_t N) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < N; ++i)
    if (target[i] != -100) rows.push_back(i);
  return rows;
}

// Copies rows[r0, r0+n) of h and target into contiguous buffers.
template <class T>
static void gather_rows(const T* h, const int64_t* target, const std::vector<int64_t>& rows, int64_t r0, int64_t n,
                        int64_t H, T* hb, int64_t* tb) {
  for (int64_t r = 0; r < n; ++r) {
    std::copy(h + rows[r0 + r] * H, h + (rows[r0 + r] + 1) * H, hb + r * H);
    tb[r] = target[rows[r0 + r]];
  }
}

// The [chunk, V] logits buffer, kept between calls: with a large vocabulary a fresh zeroed one per call costs more
// (page faults, memset) than the head's GEMM on small models.
template <class T>
static T* scratch(int64_t n) {
  thread_local std::vector<T> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// z <- scale * (softmax(z) - onehot(target)) row by row, in place: one exp per logit and no second [n, V] buffer.
// The targets were range-checked by the forward's cross_entropy.
template <class T>
static void softmax_grad_inplace(T* z, const int64_t* target, int64_t n, int64_t V, T scale) {
  for (int64_t r = 0; r < n; ++r) {
    T* x = z + r * V;
    const T mx = *std::max_element(x, x + V);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += (x[j] = std::exp(x[j] - mx));
    const T c = scale / sum;
    for (int64_t j = 0; j < V; ++j) x[j] *= c;
    x[target[r]] -= scale;
  }
}

template <class T>
double lm_head_loss_fwd(const T* h, const T* W, const int64_t* target, int64_t N, int64_t H, int64_t V,
                        T* logits_out, const Int8Weight* W8) {
  const auto head = [&](const T* x, T* y, int64_t n) {
    if (W8) ops::linear_int8_fwd(x, W8->q, W8->scale, (const T*)nullptr, y, n, H, V);
    else ops::linear_fwd(x, W, (const T*)nullptr, y, n, H, V);
  };
  double total = 0;
  if (logits_out) {
    for (int64_t i0 = 0; i0 < N; i0 += kHeadChunk) {
      const int64_t n = std::min(kHeadChunk, N - i0);
      head(h + i0 * H, logits_out + i0 * V, n);
      total += ops::cross_entropy(logits_out + i0 * V, target + i0, (T*)nullptr, (T*)nullptr, n, V, T(0));
    }
    return total;
  }
  const std::vector<int64_t> rows = supervised_rows(target, N);
  const int64_t R = (int64_t)rows.size(), C = std::min(R, kHeadChunk);
  std::vector<T> hb(C * H);
  std::vector<int64_t> tb(C);
  T* lg = scratch<T>(C * V);
  for (int64_t r0 = 0; r0 < R; r0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, R - r0);
    gather_rows(h, target, rows, r0, n, H, hb.data(), tb.data());
    head(hb.data(), lg, n);
    total += ops::cross_entropy(lg, tb.data(), (T*)nullptr, (T*)nullptr, n, V, T(0));
  }
  return total;
}

template <class T>
void lm_head_loss_bwd(const T* h, const T* W, const int64_t* target, int64_t N, int64_t H, int64_t V, T scale, T* dh,
                      T* dW) {
  const std::vector<int64_t> rows = supervised_rows(target, N);
  const int64_t R = (int64_t)rows.size(), C = std::min(R, kHeadChunk);
  std::vector<T> hb(C * H), dhb(C * H);
  std::vector<int64_t> tb(C);
  T* lg = scratch<T>(C * V);
  for (int64_t r0 = 0; r0 < R; r0 += kHeadChunk) {
    const int64_t n = std::min(kHeadChunk, R - r0);
    gather_rows(h, target, rows, r0, n, H, hb.data(), tb.data());
    ops::linear_fwd(hb.data(), W, (const T*)nullptr, lg, n, H, V);
    softmax_grad_inplace(lg, tb.data(), n, V, scale);
    std::fill(dhb.begin(), dhb.begin() + n * H, T(0));
    ops::linear_bwd(lg, hb.data(), W, dhb.data(), dW, (T*)nullptr, n, H, V);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < H; ++d) dh[rows[r0 + r] * H + d] += dhb[r * H + d];
  }
}

#define Q3VL_INST(T)                                                                                            \
  template double lm_head_loss_fwd<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, T*,         \
                                      const Int8Weight*);                                                      \
  template void lm_head_loss_bwd<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, T, T*, T*);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
