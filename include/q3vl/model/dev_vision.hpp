// The vision tower and the patch mergers on the device op layer (tensor/dev.hpp): the same forward and backward as
// the test reference's vision_embed / vision_block / merger templates (tests/reference/vision.cpp), on raw device
// pointers with a run-time dtype, so one code runs on the CPU (fp32, the reference) and on CUDA (fp32, bf16, fp16).
// Contexts and scratch are carved from arenas like DevDecoderCtx (dev_layers.hpp); nothing is allocated in a step.
//
// Host-side metadata stays on the host: the image grid list [t,h,w]*n (small) drives the per-image position
// embedding. The caller builds, once per batch, the F32 2-D rotary tables (ops::vision_rope_table over
// vision_patch_coords) and the attention segments (vision_cu_seqlens as int32, longest segment = max h*w), and
// uploads them.
#pragma once
#include <cstdint>
#include <vector>

#include "q3vl/model/config.hpp"
#include "q3vl/model/dev_layers.hpp"
#include "q3vl/tensor/dev.hpp"

namespace q3vl {

// What a vision block's backward needs from its forward (dt arrays unless noted): q and k after the rotary. q, k and
// v are one block of three [rows, D] arrays (k = q + rows*D, v = k + rows*D, rows the patches carved for; a pass of
// N <= rows uses their first N rows): the batched qkv projection's outputs (dev::LinearBatch).
struct DevVisionBlockCtx {
  void *x, *ln1, *q, *k, *v, *att, *x1, *ln2, *h, *a;  // [N,D] ..., h/a [N,I]
  float *m1, *r1, *m2, *r2;                            // [N] LayerNorm statistics
  float* lse;                                          // [N,heads]
  int64_t rows = 0;                                    // the patches carved for
  void carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt);
};
// Temporaries of one block's forward or backward, shared by all blocks (not kept). dq, dk and dv are one block of
// three [rows, D] arrays, as q, k and v.
struct DevVisionScratch {
  void *tmp, *dln, *datt, *dq, *dk, *dv;  // [N,D]
  void *da, *dh;                          // [N,I]
  int64_t rows = 0;                       // the patches carved for
  void carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt);
};

// What a merger's backward needs. The LayerNorm rows are N rows of D (main merger) or N/4 rows of 4D (postshuffle,
// DeepStack mergers): the same memory, since the 2x2 concat is a reshape of contiguous rows.
struct DevMergerCtx {
  void *x, *ln;  // [N,D]
  void *h, *a;   // [N/4,4D]
  float *m, *r;  // [N] or [N/4]
  void carve(Arena& arena, const VisionConfig& vc, bool postshuffle, int64_t N, DType dt);
};
struct DevMergerScratch {
  void *da, *dh;  // [N/4,4D]
  void* dln;      // [N,D]
  void carve(Arena& arena, const VisionConfig& vc, int64_t N, DType dt);
};

// Patch embedding (linear on the [Np, patch_dim] pixels, in dt) plus the interpolated position embedding of each
// image: x[Np, Dv] is overwritten.
void dev_vision_embed_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first,
                          const void* pixels, const std::vector<int64_t>& grid_thw, int64_t Np, void* x, DType dt);
// Weight gradients only (the pixels need none): patch_w, patch_b, pos (+)= from dx[Np, Dv].
void dev_vision_embed_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first,
                          const void* pixels, const std::vector<int64_t>& grid_thw, int64_t Np, const void* dx,
                          DType dt);

// One pre-norm ViT block, x[N, D] in place; seg = the per-(image, temporal group) segments; cos/sin [N, hd/2] F32.
void dev_vision_block_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first, void* x,
                          int64_t N, const DevSegments& seg, const float* cos, const float* sin, DevVisionBlockCtx& c,
                          DevVisionScratch& s, DType dt);
// dx holds dL/d(out) on entry and dL/d(in) on return.
void dev_vision_block_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first, void* dx,
                          int64_t N, const DevSegments& seg, const float* cos, const float* sin, DevVisionBlockCtx& c,
                          DevVisionScratch& s, DType dt);

// x[N, D] -> y[N/4, Dout] (y overwritten). postshuffle=false: main merger; true: DeepStack merger.
void dev_merger_fwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first, bool postshuffle,
                    const void* x, int64_t N, void* y, DevMergerCtx& c, DType dt);
// dx[N, D] (+)= dL/dx from dy[N/4, Dout] (accumulates, as merger_bwd: the main and DeepStack mergers' gradients
// join in one buffer; the first merger there writes it, accumulate = false).
void dev_merger_bwd(const dev::Exec& ex, const VisionConfig& vc, const DevParams& P, int first, bool postshuffle,
                    const void* dy, int64_t N, void* dx, bool accumulate, DevMergerCtx& c, DevMergerScratch& s,
                    DType dt);

}  // namespace q3vl
