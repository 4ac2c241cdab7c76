// The test reference's host layers of Qwen3-VL on the ops:: templates (one source file per layer type in
// tests/reference/), in float and double (the finite-difference checks). Each layer reads its
// weights through a parameter view (pointer per parameter id, see params.hpp) and keeps what its backward needs in a
// context struct. Backward functions take the gradient of the layer output and ACCUMULATE into input and weight
// gradients; residual blocks work in place: dx holds dL/d(out) on entry and dL/d(in) on return.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "q3vl/core/dtype.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/hooks.hpp"
#include "kv_cache.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/model/positions.hpp"

namespace q3vl {

// Bytes allocated by a list of vectors (activation memory reports).
template <class... V> int64_t vec_bytes(const V&... v) {
  return (int64_t(0) + ... + int64_t(v.capacity() * sizeof(typename V::value_type)));
}

// A parameter held in low precision for inference (model.weight_dtype = "int8", "fp8", "bf16" or "fp16"): rows
// [rows, cols] with rows the output channels (MoE experts: [E*rows, cols]) in dtype: int8 or fp8 (E4M3) with one fp32
// scale per row, W ~= q * scale[row], or bf16/fp16 rounded to nearest even (scale null). Null w: held in fp32.
enum class LowDtype : uint8_t { I8, BF16, F16, FP8 };
const char* low_dtype_name(LowDtype d);  // "int8", "bf16", "fp16", "fp8": the values of model.weight_dtype
// The 8-bit formats, one byte a weight with a scale per row (ops::quantize_rows's QFormat); else 2 bytes, no scale.
inline bool low_scaled(LowDtype d) { return d == LowDtype::I8 || d == LowDtype::FP8; }
inline QFormat low_qformat(LowDtype d) {
  return d == LowDtype::I8 ? QFormat::Int8 : d == LowDtype::FP8 ? QFormat::Fp8 : QFormat::None;
}
struct LowWeight {
  LowDtype dtype = LowDtype::I8;
  const void* w = nullptr;
  const float* scale = nullptr;
  template <class S> const S* as() const { return static_cast<const S*>(w); }
  // The view from row r of a matrix with `cols` columns (an expert's rows, a vocabulary slice, up_proj after gate).
  LowWeight from_row(int64_t r, int64_t cols) const {
    const int64_t bytes = low_scaled(dtype) ? 1 : 2;
    return {dtype, static_cast<const char*>(w) + r * cols * bytes, scale ? scale + r : nullptr};
  }
  // f(const S* rows) for the stored type S (int8_t, Bf16, Fp16, Fp8E4M3): the products are templates on it.
  template <class F> void visit(F&& f) const {
    switch (dtype) {
      case LowDtype::I8: return f(as<int8_t>());
      case LowDtype::BF16: return f(as<Bf16>());
      case LowDtype::F16: return f(as<Fp16>());
      case LowDtype::FP8: return f(as<Fp8E4M3>());
    }
  }
};

// Weights and gradients by parameter id (gradient pointers may be null for a frozen part); lora: the adapters'
// run-time settings (null: no adapters), read by lora_fwd/lora_bwd beside each wrapped linear; low: the
// low-precision copies by parameter id (null: every weight fp32); a parameter held in low precision has a null p.
template <class T> struct ParamView {
  T* const* p;
  T* const* g;
  const LoraRun* lora = nullptr;
  const LowWeight* low = nullptr;
  const LowWeight* lowp(int id) const { return low && low[id].w ? &low[id] : nullptr; }
};
// y[N,out] = x[N,in] W^T for rows [row0, row0 + out) of parameter id (row0: an expert's or a vocabulary slice's first
// row): through its low-precision copy when the view holds one, else the fp32 weight (tests/reference/decoder.cpp).
template <class T> void param_linear(const ParamView<T>& P, int id, int64_t row0, const T* x, T* y, int64_t N,
                                     int64_t in, int64_t out);

// ---- vision (tests/reference/vision.cpp) ------------------------------------------------------------------------------

// Patch embedding (linear on the 1536-vector) plus interpolated position embedding: x[Np, Dv].
template <class T> void vision_embed_fwd(const VisionConfig& vc, const ParamView<T>& P, int first, const T* pixels,
                                         const std::vector<int64_t>& grid_thw, int64_t Np, T* x);
template <class T> void vision_embed_bwd(const VisionConfig& vc, const ParamView<T>& P, int first, const T* pixels,
                                         const std::vector<int64_t>& grid_thw, int64_t Np, const T* dx);

template <class T> struct VisionBlockCtx {
  std::vector<T> x, ln1, m1, r1, q, k, v, att, lse, x1, ln2, m2, r2, h, a;
  int64_t bytes() const { return vec_bytes(x, ln1, m1, r1, q, k, v, att, lse, x1, ln2, m2, r2, h, a); }
};
template <class T> void vision_block_fwd(const VisionConfig& vc, const ParamView<T>& P, int first, T* x, int64_t N,
                                         const std::vector<int64_t>& cu, const T* cos, const T* sin,
                                         VisionBlockCtx<T>& c);
template <class T> void vision_block_bwd(const VisionConfig& vc, const ParamView<T>& P, int first, T* dx, int64_t N,
                                         const std::vector<int64_t>& cu, const T* cos, const T* sin,
                                         VisionBlockCtx<T>& c);

// ---- patch mergers (tests/reference/merger.cpp) -----------------------------------------------------------------------
// x[N, Dv] -> y[N/4, Dout]. postshuffle=false: LayerNorm over Dv then 2x2 concat (main merger);
// postshuffle=true: concat then LayerNorm over 4Dv (deepstack mergers). Both: fc1 -> erf GELU -> fc2.
template <class T> struct MergerCtx {
  std::vector<T> x, ln, m, r, h, a;
  int64_t bytes() const { return vec_bytes(x, ln, m, r, h, a); }
};
template <class T> void merger_fwd(const VisionConfig& vc, const ParamView<T>& P, int first, bool postshuffle,
                                   const T* x, int64_t N, T* y, MergerCtx<T>& c);
template <class T> void merger_bwd(const VisionConfig& vc, const ParamView<T>& P, int first, bool postshuffle,
                                   const T* dy, int64_t N, T* dx, MergerCtx<T>& c);


// ---- decoder layer (tests/reference/decoder.cpp) and MoE block (tests/reference/moe.cpp) ------------------------------------
// With expert parallelism (ex set, P.p pointing at this rank's experts only) the gathered rows go to the ranks owning
// their experts and come back; without, "sent" rows are this rank's own.
template <class T> struct MoeCtx {
  ExpertExchange* ex = nullptr;   // null: every expert is local
  bool recomputed = false;        // a backward's recomputation: its dispatch is not counted again
  std::vector<T> w;               // [N,k] renormalised routing weights
  std::vector<int64_t> start;     // [E+1] offsets of each expert's rows in the gathered buffers
  std::vector<int64_t> rows;      // gathered row -> token*k + slot
  std::vector<T> y;               // gathered [R, H] expert outputs (combined back)
  // Owner side: the rows this rank's experts got, expert-major (rank-major as they arrive: perm[i] is the
  // arrival position of expert-major row i).
  std::vector<int64_t> send_rows, recv_rows;  // per group rank
  std::vector<int64_t> ostart, perm, src;     // [El+1] expert offsets; arrival row; sending rank of each row
  std::vector<T> xo, gu;          // [Ro, H] inputs and [Ro, 2Im] pre-activations
  int64_t bytes() const { return vec_bytes(w, start, rows, y, send_rows, recv_rows, ostart, perm, src, xo, gu); }
};
// out[N,H] = MoE(x); probs [N,E] and idx [N,k] are written to caller-owned slots (pooled for the aux loss).
template <class T> void moe_fwd(const TextConfig& tc, const ParamView<T>& P, int first, const T* x, int64_t N, T* out,
                                T* probs, int64_t* idx, MoeCtx<T>& c);
// aux_dlogits [N,E] (may be null) is added to the router-logit gradient.
template <class T> void moe_bwd(const TextConfig& tc, const ParamView<T>& P, int first, const T* dout, const T* x,
                                int64_t N, T* dx, const T* probs, const int64_t* idx, const T* aux_dlogits,
                                MoeCtx<T>& c);

template <class T> struct DecoderCtx {
  std::vector<T> x, ln1, r1, qraw, kraw, rq, rk, q, k, v, att, lse, x1, ln2, r2, gu, act, mlp_out;
  MoeCtx<T> moe;
  int64_t bytes() const {
    return moe.bytes() + vec_bytes(x, ln1, r1, qraw, kraw, rq, rk, q, k, v, att, lse, x1, ln2, r2, gu, act, mlp_out);
  }
};
template <class T> void decoder_layer_fwd(const ModelConfig& cfg, const ParamView<T>& P, int first, bool moe, T* x,
                                          int64_t N, const std::vector<int64_t>& cu, const T* cos, const T* sin,
                                          T* probs, int64_t* idx, DecoderCtx<T>& c);
template <class T> void decoder_layer_bwd(const ModelConfig& cfg, const ParamView<T>& P, int first, bool moe, T* dx,
                                          int64_t N, const std::vector<int64_t>& cu, const T* cos, const T* sin,
                                          const T* probs, const int64_t* idx, const T* aux_dlogits,
                                          DecoderCtx<T>& c);

// Inference through one layer: N new tokens in segments cu, segment s extending cache sequence seqs[s]. A new token
// attends to its sequence's cached tokens and the new ones up to itself; the new keys and values are appended.
// Tensor parallelism (serve): a layer holding a slice of the heads and of the MLP's intermediate rows computes partial
// sums of o_proj's and down_proj's outputs; reduce (when set) sums them over the group, in place.
template <class T> using PartialSum = std::function<void(T*, int64_t)>;
template <class T> void decoder_layer_infer(const ModelConfig& cfg, const ParamView<T>& P, int first, bool moe, T* x,
                                            int64_t N, const std::vector<int64_t>& cu, const std::vector<int>& seqs,
                                            const T* cos, const T* sin, HostKvCache<T>& cache, int layer,
                                            const PartialSum<T>& reduce = {});

// ---- LM head + cross-entropy (tests/reference/loss.cpp), chunked over rows so logits are never all in memory ----------
// The head is parameter `head` of P (with its LoRA adapter, if any; held in low precision when P.lowp(head),
// inference). Returns the summed CE over rows whose target != -100; logits_out [N,V] is filled when non-null, otherwise only the supervised rows go through the head.
template <class T> double lm_head_loss_fwd(const ParamView<T>& P, int head, const T* h, const int64_t* target,
                                           int64_t N, int64_t H, int64_t V, T* logits_out);
// Recomputes the logits of the supervised rows chunk by chunk; dh, P.g[head] (when not null) and the adapter's
// gradients (+)= gradients of scale * summed CE.
template <class T> void lm_head_loss_bwd(const ParamView<T>& P, int head, const T* h, const int64_t* target,
                                         int64_t N, int64_t H, int64_t V, T scale, T* dh);

// ---- LoRA beside a linear (tests/reference/lora_layers.cpp) ----------------------------------------------------
// y[n*ldy + j] += scale * (B A drop(x))[n, o0 + j] for j < nout (nout < 0: all rows of B), when `id` (a base
// weight) has an adapter; no-op otherwise. x [N, in]: rows row0.. of the adapter's input in this pass (the LM head's
// chunks), which places them in the dropout mask.
template <class T> void lora_fwd(const ParamView<T>& P, int id, const T* x, int64_t N, T* y, int64_t ldy,
                                 int64_t o0 = 0, int64_t nout = -1, int64_t row0 = 0);
// The backward of that part: dA, dB (+)= their gradients, dx (+)= the input gradient (dx may be null).
template <class T> void lora_bwd(const ParamView<T>& P, int id, const T* dy, int64_t lddy, const T* x, int64_t N,
                                 T* dx, int64_t o0 = 0, int64_t nout = -1, int64_t row0 = 0);

}  // namespace q3vl
