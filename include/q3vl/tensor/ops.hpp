// CPU reference kernels (namespace q3vl::ops). Raw pointers and sizes, row-major, so that a CUDA backend can
// implement the same signatures. Templates instantiated for float (the model) and double (gradient checks).
// Convention: every backward ACCUMULATES (+=) into its gradient outputs; callers zero them first.
#pragma once
#include <cstdint>

#include "q3vl/core/dtype.hpp"

namespace q3vl::ops {

// ---- linear: y[N,out] = x[N,in] W[out,in]^T + b -------------------------------------------------------------
template <class T> void linear_fwd(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t in, int64_t out);
// dx may be null (input needs no gradient); db may be null (no bias).
template <class T> void linear_bwd(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t in,
                                   int64_t out);
// C[M,N] (+)= alpha * op(A) op(B); thin wrapper over cblas ?gemm (row-major), ldX are row strides.
template <class T> void gemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                             int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// ---- low-precision weights (inference: generate and serve with model.weight_dtype = "int8", "fp8", "bf16", "fp16") --
// Symmetric per-row quantization of W[rows, cols] into one byte a weight in format f, a row being one output channel,
// so that W ~= q * scale[r] (an all-zero row: scale 0, q 0). Int8: scale[r] = max|W[r,:]| / 127, q = round(W / scale)
// in [-127, 127]. Fp8: scale[r] = max|W[r,:]| / 448, q = f32_to_fp8_e4m3(W / scale) (nearest even, within +-448: the
// row's largest weight is exact), as vLLM's per-channel fp8. A non-finite weight is refused.
void quantize_rows(QFormat f, const float* W, int64_t rows, int64_t cols, void* q, float* scale);
inline void quantize_int8_rows(const float* W, int64_t rows, int64_t cols, int8_t* q, float* scale) {
  quantize_rows(QFormat::Int8, W, rows, cols, q, scale);
}
// W[n] rounded to nearest even into S (Bf16 or Fp16). Returns the index of the first weight S cannot hold (not
// finite, or beyond fp16's range), -1 when all converted; the caller names the parameter.
template <class S> int64_t round_to(const float* W, int64_t n, S* out);
// y[N,out] = x[N,in] W^T + b with W[out,in] stored as S (int8_t or Fp8E4M3 with scale[out] fp32, W = q *
// scale[row]; Bf16 or Fp16 with scale null), b may be null. The rows are widened to T a tile at a time (never the
// whole weight in T: exact, every S value is a float) and the scale applied after the product: y[:,o] = scale[o]
// x.q[o,:].
template <class T, class S> void linear_lowp_fwd(const T* x, const S* w, const float* scale, const T* b, T* y,
                                                 int64_t N, int64_t in, int64_t out);
// embedding_fwd on a table stored as S (a tied LM head: one row = one token = one output channel of the head).
template <class T, class S> void embedding_lowp_fwd(const int64_t* ids, const S* w, const float* scale, T* out,
                                                    int64_t N, int64_t D, int64_t V);

// ---- norms over the last dim D (N rows) ----------------------------------------------------------------------
// LayerNorm with weight+bias; saves mean and rstd per row for the backward.
template <class T> void layernorm_fwd(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int64_t N,
                                      int64_t D, double eps);
template <class T> void layernorm_bwd(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw,
                                      T* db, int64_t N, int64_t D);
// RMSNorm y = w * x / sqrt(mean(x^2) + eps); QK-norm passes N = tokens*heads so the weight is shared by heads.
template <class T> void rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd, int64_t N, int64_t D, double eps);
template <class T> void rmsnorm_bwd(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t N,
                                    int64_t D);

// ---- elementwise ------------------------------------------------------------------------------------------------
template <class T> void gelu_tanh_fwd(const T* x, T* y, int64_t n);  // gelu_pytorch_tanh (ViT MLP)
template <class T> void gelu_tanh_bwd(const T* dy, const T* x, T* dx, int64_t n);
template <class T> void gelu_erf_fwd(const T* x, T* y, int64_t n);   // nn.GELU() exact (mergers)
template <class T> void gelu_erf_bwd(const T* dy, const T* x, T* dx, int64_t n);
// SwiGLU on a fused row [gate(I) | up(I)]: y[N,I] = silu(gate) * up.
template <class T> void swiglu_fwd(const T* gu, T* y, int64_t N, int64_t I);
template <class T> void swiglu_bwd(const T* dy, const T* gu, T* dgu, int64_t N, int64_t I);

// ---- rotary -----------------------------------------------------------------------------------------------------
// x[N, heads, hd] rotated in place: x' = x*cos + rotate_half(x)*sin, rotate_half pairs d with d+hd/2.
// cos/sin are per token [N, hd/2] (HF's emb = cat(f, f) makes both halves equal).
template <class T> void rope_fwd(T* x, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t hd);
// Backward = the inverse rotation applied in place to the gradient (pure rotation).
template <class T> void rope_bwd(T* dx, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t hd);
// Rotary tables from positions: cos/sin [N, W], column c = cos/sin(float(pos[axis[c] * N + i]) * freq[c]) in fp32
// (HF's math). The columns (axis, freq: W entries each) of the two models' tables:
// - text interleaved M-RoPE (spec 4.5): W = hd/2, pos = [3][N] (T, H, W rows), sections for (T, H, W);
// - vision 2-D (spec 2.4): W = hd/2, pos = [2][N] (row, col): [row*inv(hd/4) | col*inv(hd/4)], theta 10000.
void mrope_cols(int64_t hd, double theta, const int* section, int* axis, float* freq);
void vision_rope_cols(int64_t hd, int* axis, float* freq);
template <class T, class P>
void rope_table(const P* pos, int64_t N, int64_t W, const int* axis, const float* freq, T* cos, T* sin);
// Both tables whole from int64 positions: vision from row and col arrays, text from pos3 [3][N].
template <class T> void vision_rope_table(const int64_t* row, const int64_t* col, int64_t N, int64_t hd, T* cos,
                                          T* sin);
template <class T> void mrope_table(const int64_t* pos3, int64_t N, int64_t hd, double theta, const int* section,
                                    T* cos, T* sin);

// ---- attention over packed variable-length segments -------------------------------------------------------------
// q[N,nh,hd], k/v[N,nkv,hd], out[N,nh,hd]; segment s = tokens [cu[s], cu[s+1]); tokens of different segments never
// attend to each other. GQA: query head h uses kv head h/(nh/nkv). Blockwise online softmax (never more than one
// block x block of scores); lse[N,nh] saved for the backward, which recomputes the scores block by block.
template <class T> void attention_fwd(const T* q, const T* k, const T* v, T* out, T* lse, const int64_t* cu,
                                      int64_t nseg, int64_t nh, int64_t nkv, int64_t hd, bool causal, T scale);
template <class T> void attention_bwd(const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse,
                                      T* dq, T* dk, T* dv, const int64_t* cu, int64_t nseg, int64_t nh, int64_t nkv,
                                      int64_t hd, bool causal, T scale);
// Naive full-softmax reference (tests only: materialises each segment's scores).
template <class T> void attention_ref(const T* q, const T* k, const T* v, T* out, const int64_t* cu, int64_t nseg,
                                      int64_t nh, int64_t nkv, int64_t hd, bool causal, T scale);
inline constexpr int64_t kAttnBlock = 64;

// ---- embedding --------------------------------------------------------------------------------------------------
template <class T> void embedding_fwd(const int64_t* ids, const T* table, T* out, int64_t N, int64_t D, int64_t V);
template <class T> void embedding_bwd(const int64_t* ids, const T* dout, T* dtable, int64_t N, int64_t D);

// ---- cross-entropy ----------------------------------------------------------------------------------------------
// Per row: loss[i] = logsumexp(logits[i]) - logits[i][target[i]] (0 when target == -100). If dlogits is non-null,
// dlogits[i] (+)= scale * (softmax - onehot) for non-ignored rows. Returns the sum of losses (double).
template <class T> double cross_entropy(const T* logits, const int64_t* target, T* loss, T* dlogits, int64_t N,
                                        int64_t V, T scale);

// ---- MoE router -------------------------------------------------------------------------------------------------
// probs[N,E] = softmax(logits); idx[N,k] = top-k (ties: lower index first, as torch.topk); w[N,k] renormalised.
template <class T> void router_fwd(const T* logits, T* probs, int64_t* idx, T* w, int64_t N, int64_t E, int64_t k);
// dw[N,k] -> dlogits[N,E] (+=) through renormalisation and softmax (selection is constant).
template <class T> void router_bwd(const T* dw, const T* probs, const int64_t* idx, T* dlogits, int64_t N, int64_t E,
                                   int64_t k);
// Load-balancing aux loss pooled over all rows (all MoE layers x real tokens), single softmax (spec 5.3):
// aux = E * sum_e f_e p_e, f_e = (1/N) #(rows selecting e), p_e = mean_rows probs[:, e].
template <class T> double aux_loss_fwd(const T* probs, const int64_t* idx, int64_t N, int64_t E, int64_t k, T* f_out);
// dlogits (+)= coef * d aux / d logits, using f from the forward.
template <class T> void aux_loss_bwd(const T* probs, const T* f, T coef, T* dlogits, int64_t N, int64_t E);

// ---- vision position embedding (spec 2.3, transformers-5 closed form, fp32 weights) -----------------------------
// For one image (t, h, w): out[t*h*w, D] (+)= bilinear resample of table[G*G, D] (align_corners) in patch order
// (t, br, bc, ir, ic).
template <class T> void pos_embed_fwd(const T* table, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                                      int64_t merge, T* out);
template <class T> void pos_embed_bwd(const T* dout, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                                      int64_t merge, T* dtable);

}  // namespace q3vl::ops
