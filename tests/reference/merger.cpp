// Patch mergers (spec 2.7, 2.8): 2x2 blocks of patches -> one LLM token. The main merger normalises each patch
// (over Dv) before the concat; the deepstack mergers normalise the concatenated 4Dv vector. Both use erf GELU.
#include "layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

template <class T>
void merger_fwd(const VisionConfig& vc, const ParamView<T>& P, int f, bool post, const T* x, int64_t N, T* y,
                MergerCtx<T>& c) {
  const int64_t D = vc.hidden, Dm = 4 * D, M = N / 4, Dout = vc.out_hidden;
  // Rows of the norm: N rows of D (pre-shuffle) or M rows of 4D (post-shuffle); same memory either way.
  const int64_t rows = post ? M : N, dim = post ? Dm : D;
  c.x.assign(x, x + N * D);
  c.ln.resize(N * D);
  c.m.resize(rows);
  c.r.resize(rows);
  c.h.resize(M * Dm);
  c.a.resize(M * Dm);
  ops::layernorm_fwd(x, P.p[f + vmrg::norm_w], P.p[f + vmrg::norm_b], c.ln.data(), c.m.data(), c.r.data(), rows, dim,
                     vc.ln_eps);
  ops::linear_fwd(c.ln.data(), P.p[f + vmrg::fc1_w], P.p[f + vmrg::fc1_b], c.h.data(), M, Dm, Dm);
  lora_fwd(P, f + vmrg::fc1_w, c.ln.data(), M, c.h.data(), Dm);
  ops::gelu_erf_fwd(c.h.data(), c.a.data(), M * Dm);
  ops::linear_fwd(c.a.data(), P.p[f + vmrg::fc2_w], P.p[f + vmrg::fc2_b], y, M, Dm, Dout);
  lora_fwd(P, f + vmrg::fc2_w, c.a.data(), M, y, Dout);
}

template <class T>
void merger_bwd(const VisionConfig& vc, const ParamView<T>& P, int f, bool post, const T* dy, int64_t N, T* dx,
                MergerCtx<T>& c) {
  const int64_t D = vc.hidden, Dm = 4 * D, M = N / 4, Dout = vc.out_hidden;
  const int64_t rows = post ? M : N, dim = post ? Dm : D;
  std::vector<T> da(M * Dm), dh(M * Dm), dln(N * D);
  ops::linear_bwd(dy, c.a.data(), P.p[f + vmrg::fc2_w], da.data(), P.g[f + vmrg::fc2_w], P.g[f + vmrg::fc2_b], M, Dm,
                  Dout);
  lora_bwd(P, f + vmrg::fc2_w, dy, Dout, c.a.data(), M, da.data());
  ops::gelu_erf_bwd(da.data(), c.h.data(), dh.data(), M * Dm);
  ops::linear_bwd(dh.data(), c.ln.data(), P.p[f + vmrg::fc1_w], dln.data(), P.g[f + vmrg::fc1_w],
                  P.g[f + vmrg::fc1_b], M, Dm, Dm);
  lora_bwd(P, f + vmrg::fc1_w, dh.data(), Dm, c.ln.data(), M, dln.data());
  ops::layernorm_bwd(dln.data(), c.x.data(), P.p[f + vmrg::norm_w], c.m.data(), c.r.data(), dx, P.g[f + vmrg::norm_w],
                     P.g[f + vmrg::norm_b], rows, dim);
}

#define Q3VL_INST(T)                                                                                               \
  template void merger_fwd<T>(const VisionConfig&, const ParamView<T>&, int, bool, const T*, int64_t, T*,         \
                              MergerCtx<T>&);                                                                     \
  template void merger_bwd<T>(const VisionConfig&, const ParamView<T>&, int, bool, const T*, int64_t, T*,         \
                              MergerCtx<T>&);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
