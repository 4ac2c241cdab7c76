// Vision tower pieces and patch mergers on the device op layer (spec 2.2-2.8): patch embedding + interpolated
// position embedding, the pre-norm ViT block with 2-D rotary and per-image bidirectional attention, and the main /
// DeepStack mergers. The op sequence is vision.cpp's and merger.cpp's, so on the CPU in fp32 it computes what the
// templated layers compute.
#include <cmath>
#include <string>

#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_vision.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

void DevVisionBlockCtx::carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt) {
  const int64_t D = vc.hidden, I = vc.intermediate;
  x = arena.take(N * D, dt), ln1 = arena.take(N * D, dt);
  // q, k and v in one block of three [N, D] arrays (N: the patches carved for, kept as rows): the batched qkv
  // projection writes them N*D elements apart.
  rows = N;
  q = arena.take(3 * N * D, dt), k = q ? at(q, N * D, dt) : nullptr, v = q ? at(q, 2 * N * D, dt) : nullptr;
  att = arena.take(N * D, dt);
  x1 = arena.take(N * D, dt), ln2 = arena.take(N * D, dt);
  h = arena.take(N * I, dt), a = arena.take(N * I, dt);
  m1 = arena.take<float>(N, DType::F32), r1 = arena.take<float>(N, DType::F32);
  m2 = arena.take<float>(N, DType::F32), r2 = arena.take<float>(N, DType::F32);
  lse = arena.take<float>(N * vc.heads, DType::F32);
}

void DevVisionScratch::carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt) {
  const int64_t D = vc.hidden, I = vc.intermediate;
  tmp = arena.take(N * D, dt), dln = arena.take(N * D, dt), datt = arena.take(N * D, dt);
  // dq, dk and dv in one block of three [N, D] arrays (as q, k, v), the batched qkv backward's dy N*D elements apart.
  rows = N;
  dq = arena.take(3 * N * D, dt), dk = dq ? at(dq, N * D, dt) : nullptr, dv = dq ? at(dq, 2 * N * D, dt) : nullptr;
  da = arena.take(N * I, dt), dh = arena.take(N * I, dt);
}

void DevMergerCtx::carve(Arena& arena, const VisionConfig& vc, bool postshuffle, int64_t N, DType dt) {
  const int64_t D = vc.hidden, M = N / 4, rows = postshuffle ? M : N;
  x = arena.take(N * D, dt), ln = arena.take(N * D, dt);
  h = arena.take(M * 4 * D, dt), a = arena.take(M * 4 * D, dt);
  m = arena.take<float>(rows, DType::F32), r = arena.take<float>(rows, DType::F32);
}

void DevMergerScratch::carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt) {
  const int64_t D = vc.hidden, M = N / 4;
  da = arena.take(M * 4 * D, dt), dh = arena.take(M * 4 * D, dt), dln = arena.take(N * D, dt);
}

namespace {
int64_t pos_side(const VisionConfig& vc) {
  const int64_t G = std::lround(std::sqrt(double(vc.num_position_embeddings)));
  if (G * G != vc.num_position_embeddings) fail("vision num_position_embeddings must be a square");
  return G;
}
// The grid list is host metadata: checked here because a device kernel cannot report a bad grid.
void check_grid(const VisionConfig& vc, const std::vector<int64_t>& grid, int64_t Np) {
  Q3VL_CHECK(grid.size() % 3 == 0, "image_grid_thw must have 3 entries per image");
  int64_t n = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    Q3VL_CHECK(grid[i] > 0 && grid[i + 1] > 0 && grid[i + 2] > 0 && grid[i + 1] % vc.merge == 0 &&
                   grid[i + 2] % vc.merge == 0,
               "image_grid_thw row " + std::to_string(i / 3) + " is not a positive grid divisible by the merge size");
    n += grid[i] * grid[i + 1] * grid[i + 2];
  }
  Q3VL_CHECK(n == Np, "image_grid_thw covers " + std::to_string(n) + " patches, not " + std::to_string(Np));
}
// The fused qkv projection as three problems of one batched linear: the input ln1 shared, the row blocks [q; k; v]
// of the [3D, D] weight and [3D] bias, the outputs (and their gradients) q | k | v, arrays of `rows` carved rows
// (rows*D elements apart) whose first N a pass of N patches uses.
dev::LinearBatch qkv_batch(int64_t N, int64_t rows, int64_t D) {
  Q3VL_CHECK(N <= rows, "vision block: " + std::to_string(N) + " patches in buffers carved for " +
                            std::to_string(rows));
  return {3, 0, D * D, D, rows * D};
}
}  // namespace

// ---- patch + position embedding ----------------------------------------------------------------------------------

void dev_vision_embed_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, const void* pixels,
                          const std::vector<int64_t>& grid, int64_t Np, void* x, DType dt) {
  const int64_t Dv = vc.hidden, G = pos_side(vc);
  check_grid(vc, grid, Np);
  dev::linear_fwd(ex, pixels, P.p[f + vemb::patch_w], P.p[f + vemb::patch_b], x, Np, int64_t(vc.patch_dim()), Dv,
                  dt);
  int64_t off = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    dev::pos_embed_fwd(ex, P.p[f + vemb::pos], G, Dv, grid[i], grid[i + 1], grid[i + 2], vc.merge, at(x, off * Dv, dt),
                       dt);
    off += grid[i] * grid[i + 1] * grid[i + 2];
  }
}

void dev_vision_embed_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, const void* pixels,
                          const std::vector<int64_t>& grid, int64_t Np, const void* dx, DType dt) {
  const int64_t Dv = vc.hidden, G = pos_side(vc);
  check_grid(vc, grid, Np);
  dev::linear_bwd(ex, dx, pixels, P.p[f + vemb::patch_w], nullptr, P.g[f + vemb::patch_w], P.g[f + vemb::patch_b], Np,
                  int64_t(vc.patch_dim()), Dv, true, dev_grad_adds(ex, P, {f + vemb::patch_w, f + vemb::patch_b}), dt);
  if (!P.g[f + vemb::pos]) return;  // frozen table
  dev_grad_zeroed(ex, P, f + vemb::pos);
  int64_t off = 0;
  for (size_t i = 0; i < grid.size(); i += 3) {
    dev::pos_embed_bwd(ex, at(dx, off * Dv, dt), G, Dv, grid[i], grid[i + 1], grid[i + 2], vc.merge,
                       P.g[f + vemb::pos], dt);
    off += grid[i] * grid[i + 1] * grid[i + 2];
  }
}

// ---- ViT block -----------------------------------------------------------------------------------------------------

void dev_vision_block_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, void* x, int64_t N,
                          const DevSegments& seg, const float* cos, const float* sin, DevVisionBlockCtx& c,
                          DevVisionScratch& s, DType dt) {
  const int64_t D = vc.hidden, I = vc.intermediate, nh = vc.heads, hd = vc.head_dim();
  const float scale = float(1 / std::sqrt(double(hd)));
  dev::copy(ex, c.x, x, size_t(N * D) * dtype_size(dt));
  dev::layernorm_fwd(ex, x, P.p[f + vblk::norm1_w], P.p[f + vblk::norm1_b], c.ln1, c.m1, c.r1, N, D, vc.ln_eps, dt);
  // qkv rows are [q; k; v] blocks, each head-major: one batched linear of three problems on row blocks of one
  // weight, so q, k and v come out as the contiguous [N, heads, hd] arrays the rotary and attention ops take.
  dev::linear_fwd_batched(ex, c.ln1, P.p[f + vblk::qkv_w], P.p[f + vblk::qkv_b], c.q, N, D, D,
                          qkv_batch(N, c.rows, D), dt);
  void* qkv[3] = {c.q, c.k, c.v};
  for (int j = 0; j < 3; ++j)
    dev_lora_fwd(ex, P, f + vblk::qkv_w, c.ln1, N, qkv[j], D, dt, j * D, D);  // PEFT wraps qkv whole: rows j*D.. of B
  dev::rope_fwd(ex, c.q, cos, sin, N, nh, hd, dt);
  dev::rope_fwd(ex, c.k, cos, sin, N, nh, hd, dt);
  dev::attention_fwd(ex, c.q, c.k, c.v, c.att, c.lse, seg.cu, seg.nseg, seg.max_len, N, nh, nh, hd, false, scale, dt);
  dev::linear_fwd(ex, c.att, P.p[f + vblk::proj_w], P.p[f + vblk::proj_b], s.tmp, N, D, D, dt);
  dev_lora_fwd(ex, P, f + vblk::proj_w, c.att, N, s.tmp, D, dt);
  dev::axpy(ex, 1.f, s.tmp, x, N * D, dt);
  dev::copy(ex, c.x1, x, size_t(N * D) * dtype_size(dt));
  dev::layernorm_fwd(ex, x, P.p[f + vblk::norm2_w], P.p[f + vblk::norm2_b], c.ln2, c.m2, c.r2, N, D, vc.ln_eps, dt);
  dev::linear_fwd(ex, c.ln2, P.p[f + vblk::fc1_w], P.p[f + vblk::fc1_b], c.h, N, D, I, dt);
  dev_lora_fwd(ex, P, f + vblk::fc1_w, c.ln2, N, c.h, I, dt);
  dev::gelu_tanh_fwd(ex, c.h, c.a, N * I, dt);
  dev::linear_fwd(ex, c.a, P.p[f + vblk::fc2_w], P.p[f + vblk::fc2_b], s.tmp, N, I, D, dt);
  dev_lora_fwd(ex, P, f + vblk::fc2_w, c.a, N, s.tmp, D, dt);
  dev::axpy(ex, 1.f, s.tmp, x, N * D, dt);
}

void dev_vision_block_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, void* dx, int64_t N,
                          const DevSegments& seg, const float* cos, const float* sin, DevVisionBlockCtx& c,
                          DevVisionScratch& s, DType dt) {
  const int64_t D = vc.hidden, I = vc.intermediate, nh = vc.heads, hd = vc.head_dim();
  const float scale = float(1 / std::sqrt(double(hd)));
  // MLP branch: dx (the residual's gradient) also receives the norm2 branch (layernorm_bwd accumulates into it).
  // The first op to produce a gradient buffer writes it, the later ones add (dev.hpp).
  dev::linear_bwd(ex, dx, c.a, P.p[f + vblk::fc2_w], s.da, P.g[f + vblk::fc2_w], P.g[f + vblk::fc2_b], N, I, D, false,
                  dev_grad_adds(ex, P, {f + vblk::fc2_w, f + vblk::fc2_b}), dt);
  dev_lora_bwd(ex, P, f + vblk::fc2_w, dx, D, c.a, N, s.da, dt);
  dev::gelu_tanh_bwd(ex, s.da, c.h, s.dh, N * I, false, dt);
  dev::linear_bwd(ex, s.dh, c.ln2, P.p[f + vblk::fc1_w], s.dln, P.g[f + vblk::fc1_w], P.g[f + vblk::fc1_b], N, D, I,
                  false, dev_grad_adds(ex, P, {f + vblk::fc1_w, f + vblk::fc1_b}), dt);
  dev_lora_bwd(ex, P, f + vblk::fc1_w, s.dh, I, c.ln2, N, s.dln, dt);
  dev_grad_zeroed(ex, P, f + vblk::norm2_w);
  dev_grad_zeroed(ex, P, f + vblk::norm2_b);
  dev::layernorm_bwd(ex, s.dln, c.x1, P.p[f + vblk::norm2_w], c.m2, c.r2, dx, P.g[f + vblk::norm2_w],
                     P.g[f + vblk::norm2_b], N, D, true, dt);
  // Attention branch.
  dev::linear_bwd(ex, dx, c.att, P.p[f + vblk::proj_w], s.datt, P.g[f + vblk::proj_w], P.g[f + vblk::proj_b], N, D, D,
                  false, dev_grad_adds(ex, P, {f + vblk::proj_w, f + vblk::proj_b}), dt);
  dev_lora_bwd(ex, P, f + vblk::proj_w, dx, D, c.att, N, s.datt, dt);
  dev::attention_bwd(ex, s.datt, c.q, c.k, c.v, c.att, c.lse, s.dq, s.dk, s.dv, seg.cu, seg.nseg, seg.max_len, N, nh,
                     nh, hd, false, scale, false, dt);
  dev::rope_bwd(ex, s.dq, cos, sin, N, nh, hd, dt);
  dev::rope_bwd(ex, s.dk, cos, sin, N, nh, hd, dt);
  // dW_j, db_j of the three row blocks as one batched backward; dln, their shared input's gradient, is written by
  // q's part and added to by k's and v's (then by the adapters').
  const bool add_qkv = dev_grad_adds(ex, P, {f + vblk::qkv_w, f + vblk::qkv_b});  // the step's first: written
  dev::linear_bwd_batched(ex, s.dq, c.ln1, P.p[f + vblk::qkv_w], s.dln, P.g[f + vblk::qkv_w], P.g[f + vblk::qkv_b], N,
                          D, D, qkv_batch(N, s.rows, D), false, add_qkv, dt);
  const void* d3[3] = {s.dq, s.dk, s.dv};
  for (int j = 0; j < 3; ++j) dev_lora_bwd(ex, P, f + vblk::qkv_w, d3[j], D, c.ln1, N, s.dln, dt, j * D, D);
  dev_grad_zeroed(ex, P, f + vblk::norm1_w);
  dev_grad_zeroed(ex, P, f + vblk::norm1_b);
  dev::layernorm_bwd(ex, s.dln, c.x, P.p[f + vblk::norm1_w], c.m1, c.r1, dx, P.g[f + vblk::norm1_w],
                     P.g[f + vblk::norm1_b], N, D, true, dt);
}

// ---- patch mergers ---------------------------------------------------------------------------------------------------
// Patches are in (t, br, bc, ir, ic) order (vision_patch_coords), so the four patches of one 2x2 block are
// consecutive rows: the concat [N, D] -> [N/4, 4D] is the same contiguous memory read with a wider row, no row move.

void dev_merger_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, bool post, const void* x,
                    int64_t N, void* y, DevMergerCtx& c, DType dt) {
  Q3VL_CHECK(N % 4 == 0, "merger: " + std::to_string(N) + " patches is not a whole number of 2x2 blocks");
  const int64_t D = vc.hidden, Dm = 4 * D, M = N / 4, Dout = vc.out_hidden;
  const int64_t rows = post ? M : N, dim = post ? Dm : D;
  dev::copy(ex, c.x, x, size_t(N * D) * dtype_size(dt));
  dev::layernorm_fwd(ex, x, P.p[f + vmrg::norm_w], P.p[f + vmrg::norm_b], c.ln, c.m, c.r, rows, dim, vc.ln_eps, dt);
  dev::linear_fwd(ex, c.ln, P.p[f + vmrg::fc1_w], P.p[f + vmrg::fc1_b], c.h, M, Dm, Dm, dt);
  dev_lora_fwd(ex, P, f + vmrg::fc1_w, c.ln, M, c.h, Dm, dt);
  dev::gelu_erf_fwd(ex, c.h, c.a, M * Dm, dt);
  dev::linear_fwd(ex, c.a, P.p[f + vmrg::fc2_w], P.p[f + vmrg::fc2_b], y, M, Dm, Dout, dt);
  dev_lora_fwd(ex, P, f + vmrg::fc2_w, c.a, M, y, Dout, dt);
}

void dev_merger_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int f, bool post, const void* dy,
                    int64_t N, void* dx, bool accumulate, DevMergerCtx& c, DevMergerScratch& s, DType dt) {
  Q3VL_CHECK(N % 4 == 0, "merger: " + std::to_string(N) + " patches is not a whole number of 2x2 blocks");
  const int64_t D = vc.hidden, Dm = 4 * D, M = N / 4, Dout = vc.out_hidden;
  const int64_t rows = post ? M : N, dim = post ? Dm : D;
  dev::linear_bwd(ex, dy, c.a, P.p[f + vmrg::fc2_w], s.da, P.g[f + vmrg::fc2_w], P.g[f + vmrg::fc2_b], M, Dm, Dout,
                  false, dev_grad_adds(ex, P, {f + vmrg::fc2_w, f + vmrg::fc2_b}), dt);
  dev_lora_bwd(ex, P, f + vmrg::fc2_w, dy, Dout, c.a, M, s.da, dt);
  dev::gelu_erf_bwd(ex, s.da, c.h, s.dh, M * Dm, false, dt);
  dev::linear_bwd(ex, s.dh, c.ln, P.p[f + vmrg::fc1_w], s.dln, P.g[f + vmrg::fc1_w], P.g[f + vmrg::fc1_b], M, Dm, Dm,
                  false, dev_grad_adds(ex, P, {f + vmrg::fc1_w, f + vmrg::fc1_b}), dt);
  dev_lora_bwd(ex, P, f + vmrg::fc1_w, s.dh, Dm, c.ln, M, s.dln, dt);
  dev_grad_zeroed(ex, P, f + vmrg::norm_w);
  dev_grad_zeroed(ex, P, f + vmrg::norm_b);
  dev::layernorm_bwd(ex, s.dln, c.x, P.p[f + vmrg::norm_w], c.m, c.r, dx, P.g[f + vmrg::norm_w], P.g[f + vmrg::norm_b],
                     rows, dim, accumulate, dt);
}

}  // namespace q3vl
