// Vision tower pieces (spec 2): patch embedding, interpolated position embedding, 2-D rotary coordinates,
// and the pre-norm ViT block with per-image block-diagonal attention.
#include <cmath>

#include "q3vl/core/error.hpp"
#include "layers.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

static int64_t pos_side(const VisionConfig& vc) {
  const int64_t G = (int64_t)std::lround(std::sqrt((double)vc.num_position_embeddings));
  if (G * G != vc.num_position_embeddings) fail("vision num_position_embeddings must be a square");
  return G;
}

template <class T>
void vision_embed_fwd(const VisionConfig& vc, const ParamView<T>& P, int first, const T* pixels,
                      const std::vector<int64_t>& grid, int64_t Np, T* x) {
  const int64_t Dv = vc.hidden, G = pos_side(vc);
  ops::linear_fwd(pixels, P.p[first + vemb::patch_w], P.p[first + vemb::patch_b], x, Np, (int64_t)vc.patch_dim(), Dv);
  int64_t off = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    ops::pos_embed_fwd(P.p[first + vemb::pos], G, Dv, grid[i], grid[i + 1], grid[i + 2], vc.merge, x + off * Dv);
    off += grid[i] * grid[i + 1] * grid[i + 2];
  }
}

template <class T>
void vision_embed_bwd(const VisionConfig& vc, const ParamView<T>& P, int first, const T* pixels,
                      const std::vector<int64_t>& grid, int64_t Np, const T* dx) {
  const int64_t Dv = vc.hidden, G = pos_side(vc);
  ops::linear_bwd(dx, pixels, P.p[first + vemb::patch_w], (T*)nullptr, P.g[first + vemb::patch_w],
                  P.g[first + vemb::patch_b], Np, (int64_t)vc.patch_dim(), Dv);
  int64_t off = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    ops::pos_embed_bwd(dx + off * Dv, G, Dv, grid[i], grid[i + 1], grid[i + 2], vc.merge, P.g[first + vemb::pos]);
    off += grid[i] * grid[i + 1] * grid[i + 2];
  }
}

template <class T>
void vision_block_fwd(const VisionConfig& vc, const ParamView<T>& P, int f, T* x, int64_t N,
                      const std::vector<int64_t>& cu, const T* cos, const T* sin, VisionBlockCtx<T>& c) {
  const int64_t D = vc.hidden, I = vc.intermediate, nh = vc.heads, hd = vc.head_dim();
  const T* qkv_w = P.p[f + vblk::qkv_w];
  const T* qkv_b = P.p[f + vblk::qkv_b];
  c.x.assign(x, x + N * D);
  for (auto* v : {&c.ln1, &c.q, &c.k, &c.v, &c.att, &c.ln2}) v->resize(N * D);
  for (auto* v : {&c.m1, &c.r1, &c.m2, &c.r2}) v->resize(N);
  c.lse.resize(N * nh);
  c.h.resize(N * I);
  c.a.resize(N * I);
  ops::layernorm_fwd(x, P.p[f + vblk::norm1_w], P.p[f + vblk::norm1_b], c.ln1.data(), c.m1.data(), c.r1.data(), N, D,
                     vc.ln_eps);
  // qkv rows are [q; k; v] blocks, each head-major: three GEMMs on row blocks of one weight.
  T* qkv[3] = {c.q.data(), c.k.data(), c.v.data()};
  for (int j = 0; j < 3; ++j) {
    ops::linear_fwd(c.ln1.data(), qkv_w + j * D * D, qkv_b + j * D, qkv[j], N, D, D);
    lora_fwd(P, f + vblk::qkv_w, c.ln1.data(), N, qkv[j], D, j * D, D);  // PEFT wraps qkv whole: rows j*D.. of B
  }
  ops::rope_fwd(c.q.data(), cos, sin, N, nh, hd);
  ops::rope_fwd(c.k.data(), cos, sin, N, nh, hd);
  ops::attention_fwd(c.q.data(), c.k.data(), c.v.data(), c.att.data(), c.lse.data(), cu.data(),
                     (int64_t)cu.size() - 1, nh, nh, hd, false, T(1 / std::sqrt((double)hd)));
  std::vector<T> tmp(N * D);
  ops::linear_fwd(c.att.data(), P.p[f + vblk::proj_w], P.p[f + vblk::proj_b], tmp.data(), N, D, D);
  lora_fwd(P, f + vblk::proj_w, c.att.data(), N, tmp.data(), D);
  for (int64_t i = 0; i < N * D; ++i) x[i] += tmp[i];
  c.x1.assign(x, x + N * D);
  ops::layernorm_fwd(x, P.p[f + vblk::norm2_w], P.p[f + vblk::norm2_b], c.ln2.data(), c.m2.data(), c.r2.data(), N, D,
                     vc.ln_eps);
  ops::linear_fwd(c.ln2.data(), P.p[f + vblk::fc1_w], P.p[f + vblk::fc1_b], c.h.data(), N, D, I);
  lora_fwd(P, f + vblk::fc1_w, c.ln2.data(), N, c.h.data(), I);
  ops::gelu_tanh_fwd(c.h.data(), c.a.data(), N * I);
  ops::linear_fwd(c.a.data(), P.p[f + vblk::fc2_w], P.p[f + vblk::fc2_b], tmp.data(), N, I, D);
  lora_fwd(P, f + vblk::fc2_w, c.a.data(), N, tmp.data(), D);
  for (int64_t i = 0; i < N * D; ++i) x[i] += tmp[i];
}

template <class T>
void vision_block_bwd(const VisionConfig& vc, const ParamView<T>& P, int f, T* dx, int64_t N,
                      const std::vector<int64_t>& cu, const T* cos, const T* sin, VisionBlockCtx<T>& c) {
  const int64_t D = vc.hidden, I = vc.intermediate, nh = vc.heads, hd = vc.head_dim();
  // MLP branch.
  std::vector<T> da(N * I), dh(N * I), dln(N * D);
  ops::linear_bwd(dx, c.a.data(), P.p[f + vblk::fc2_w], da.data(), P.g[f + vblk::fc2_w], P.g[f + vblk::fc2_b], N, I,
                  D);
  lora_bwd(P, f + vblk::fc2_w, dx, D, c.a.data(), N, da.data());
  ops::gelu_tanh_bwd(da.data(), c.h.data(), dh.data(), N * I);
  ops::linear_bwd(dh.data(), c.ln2.data(), P.p[f + vblk::fc1_w], dln.data(), P.g[f + vblk::fc1_w],
                  P.g[f + vblk::fc1_b], N, D, I);
  lora_bwd(P, f + vblk::fc1_w, dh.data(), I, c.ln2.data(), N, dln.data());
  ops::layernorm_bwd(dln.data(), c.x1.data(), P.p[f + vblk::norm2_w], c.m2.data(), c.r2.data(), dx,
                     P.g[f + vblk::norm2_w], P.g[f + vblk::norm2_b], N, D);
  // Attention branch.
  std::vector<T> datt(N * D), dq(N * D), dk(N * D), dv(N * D);
  ops::linear_bwd(dx, c.att.data(), P.p[f + vblk::proj_w], datt.data(), P.g[f + vblk::proj_w], P.g[f + vblk::proj_b],
                  N, D, D);
  lora_bwd(P, f + vblk::proj_w, dx, D, c.att.data(), N, datt.data());
  ops::attention_bwd(datt.data(), c.q.data(), c.k.data(), c.v.data(), c.att.data(), c.lse.data(), dq.data(),
                     dk.data(), dv.data(), cu.data(), (int64_t)cu.size() - 1, nh, nh, hd, false,
                     T(1 / std::sqrt((double)hd)));
  ops::rope_bwd(dq.data(), cos, sin, N, nh, hd);
  ops::rope_bwd(dk.data(), cos, sin, N, nh, hd);
  std::fill(dln.begin(), dln.end(), T(0));
  const T* d3[3] = {dq.data(), dk.data(), dv.data()};
  const T* qkv_w = P.p[f + vblk::qkv_w];
  for (int j = 0; j < 3; ++j) {
    ops::linear_bwd(d3[j], c.ln1.data(), qkv_w + j * D * D, dln.data(),
                    P.g[f + vblk::qkv_w] ? P.g[f + vblk::qkv_w] + j * D * D : nullptr,
                    P.g[f + vblk::qkv_b] ? P.g[f + vblk::qkv_b] + j * D : nullptr, N, D, D);
    lora_bwd(P, f + vblk::qkv_w, d3[j], D, c.ln1.data(), N, dln.data(), j * D, D);
  }
  ops::layernorm_bwd(dln.data(), c.x.data(), P.p[f + vblk::norm1_w], c.m1.data(), c.r1.data(), dx,
                     P.g[f + vblk::norm1_w], P.g[f + vblk::norm1_b], N, D);
}

#define Q3VL_INST(T)                                                                                                 \
  template void vision_embed_fwd<T>(const VisionConfig&, const ParamView<T>&, int, const T*,                        \
                                    const std::vector<int64_t>&, int64_t, T*);                                      \
  template void vision_embed_bwd<T>(const VisionConfig&, const ParamView<T>&, int, const T*,                        \
                                    const std::vector<int64_t>&, int64_t, const T*);                                \
  template void vision_block_fwd<T>(const VisionConfig&, const ParamView<T>&, int, T*, int64_t,                     \
                                    const std::vector<int64_t>&, const T*, const T*, VisionBlockCtx<T>&);           \
  template void vision_block_bwd<T>(const VisionConfig&, const ParamView<T>&, int, T*, int64_t,                     \
                                    const std::vector<int64_t>&, const T*, const T*, VisionBlockCtx<T>&);
Q3VL_INST(float)
Q3VL_INST(double)
#undef Q3VL_INST

}  // namespace q3vl
