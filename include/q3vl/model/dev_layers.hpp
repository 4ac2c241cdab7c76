// Layers on the device op layer (tensor/dev.hpp): the same forward and backward as layers.hpp's templates, but on
// raw device pointers with a run-time dtype, so one layer code runs on the CPU (fp32, the reference) and on CUDA
// (fp32, bf16, fp16). Contexts and scratch are carved from arenas sized once from the config and the token count
// (Arena's counting mode is the sizing the planner reuses); nothing is allocated inside a step.
// LoRA (model/lora.hpp) is not here yet: train and eval refuse lora.rank > 0 on model.backend = cuda. Its place is
// beside each wrapped linear, as in decoder.cpp/vision.cpp/merger.cpp: two thin GEMMs (u = drop(x) A^T kept or
// recomputed, y += scale u B^T; backward dB, du, dA, dx), the dropout mask from lora.cpp's counter hash, A/B in the
// unit's parameter buffer at the table's offsets, and base weight gradients skipped (null) for the frozen base.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#include "q3vl/model/config.hpp"
#include "q3vl/tensor/dev.hpp"

namespace q3vl {

// A bump allocator over one device block. With base == nullptr it only counts (sizing); carving the same sequence
// from a real block of the counted size then cannot run out.
struct Arena {
  char* base = nullptr;
  size_t cap = 0, used = 0;
  void* take(size_t bytes);
  template <class T = void> T* take(int64_t n, DType t) { return static_cast<T*>(take(size_t(n) * dtype_size(t))); }
  void reset() { used = 0; }
};

// Weights by parameter id in the compute dtype (device pointers), gradients F32 (null: frozen or forward only).
struct DevParams {
  const void* const* p;
  float* const* g;
  // Inference with int8 weights (model.weight_dtype = "int8"): per id its int8 rows and fp32 row scales, null for a
  // weight held in dt (then in p).
  const int8_t* const* q8 = nullptr;
  const float* const* s8 = nullptr;
};
// y[N, n_out] = x[N, n_in] W^T for rows [row0, row0 + n_out) of parameter id (no bias; row0: a vocabulary slice's
// first row), W its int8 rows when it has them, else its dt weight.
void dev_linear(const dev::Exec& ex, const DevParams& P, int id, const void* x, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt, int64_t row0 = 0);

// Element offset into a dt array.
inline void* at(void* p, int64_t i, DType t) { return static_cast<char*>(p) + i * int64_t(dtype_size(t)); }
inline const void* at(const void* p, int64_t i, DType t) {
  return static_cast<const char*>(p) + i * int64_t(dtype_size(t));
}

// What a decoder layer's backward needs from its forward (dt arrays unless noted). MoE layers keep the routing and
// the experts' pre-activations; probs/idx are pooled by the caller for the aux loss.
struct DevDecoderCtx {
  void *x, *ln1, *qraw, *kraw, *q, *k, *v, *att, *x1, *ln2, *gu, *act;
  float *r1, *rq, *rk, *lse, *r2;
  float* w;                      // MoE: [N,k] routing weights
  int32_t *start, *rows, *pos;   // MoE: expert buckets
  void *egu, *ey;                // MoE: [R,2Im] pre-activation, [R,H] expert outputs
  void carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt);
};
// Temporaries of one layer's forward or backward, shared by all layers (not kept).
struct DevDecoderScratch {
  void *tmp, *dln, *dact, *dgu, *datt, *dq, *dk, *dv, *dqr, *dkr;
  void *logits, *xg, *eact, *dyg, *edact, *edgu, *dxg, *dlogits;  // MoE (logits, dlogits: [N,E] F32)
  float* dw;                                                      // MoE: [R]
  void carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt);
};

// Packed segments on the device: cu [nseg+1] int32 and the longest segment.
struct DevSegments {
  const int32_t* cu = nullptr;
  int64_t nseg = 0, max_len = 0;
};

// x[N,H] in place (the residual stream). probs [N,E] F32 / idx [N,k] int32: caller-owned slots (MoE).
void dev_decoder_fwd(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int first, bool moe, void* x,
                     int64_t N, const DevSegments& seg, const float* cos, const float* sin, float* probs,
                     int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, DType dt);
// dx holds dL/d(out) on entry and dL/d(in) on return; aux_dlogits [N,E] F32 (may be null) joins the router's
// logit gradient.
void dev_decoder_bwd(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int first, bool moe, void* dx,
                     int64_t N, const DevSegments& seg, const float* cos, const float* sin, const float* probs,
                     const int32_t* idx, const void* aux_dlogits, DevDecoderCtx& c, DevDecoderScratch& s, DType dt);

// Inference through one layer against a paged KV cache (serve; layers.hpp's decoder_layer_infer on the device): N
// new tokens x[N,H] in place; their keys/values (after QK-norm and RoPE) are written to pool rows slots[N] of
// k_pool/v_pool [rows, nkv, hd] and each attends to its sequence's cache (cache: dev::paged_attention_fwd's
// arguments). Only the forward's buffers of c and s are used, nothing is kept. reduce (may be empty) sums a
// tensor-parallel slice's partial o_proj and MLP outputs [N,H] over the group, in place. Residual adds go with the
// next norm (dev::residual_rmsnorm_fwd): `pending` (may be null) is the previous layer's MLP output, added to x here,
// and this layer leaves its own MLP output in s.tmp, not yet added (the caller adds the last one).
struct DevPagedCache {
  void *k, *v;                 // this layer's pools
  const int32_t *slots, *cu, *ctx, *table;
  int64_t max_blocks, block, nseg, max_q, max_ctx;
};
using DevPartialSum = std::function<void(void*, int64_t)>;
void dev_decoder_infer(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int first, bool moe, void* x,
                       int64_t N, const DevPagedCache& kv, const float* cos, const float* sin, float* probs,
                       int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, const DevPartialSum& reduce,
                       const void* pending, DType dt);

}  // namespace q3vl
