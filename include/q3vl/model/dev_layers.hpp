// Layers on the device op layer (tensor/dev.hpp): the same forward and backward as layers.hpp's templates, but on
// raw device pointers with a run-time dtype, so one layer code runs on the CPU (fp32, the reference) and on CUDA
// (fp32, bf16, fp16). Contexts and scratch are carved from arenas sized once from the config and the token count
// (Arena's counting mode is the sizing the planner reuses); nothing is allocated inside a step.
// LoRA (model/lora.hpp) sits beside each wrapped linear (dev_lora_fwd / dev_lora_bwd): two thin GEMMs, the dropout
// mask from lora.cpp's counter hash, A and B in the unit's parameter buffer at the table's offsets; a frozen base
// has null gradients.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <vector>

#include "q3vl/model/config.hpp"
#include "q3vl/model/hooks.hpp"
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

class ParamTable;
struct DevLora;

// Weights by parameter id in the compute dtype (device pointers), gradients F32 (null: frozen or forward only).
struct DevParams {
  const void* const* p;
  float* const* g;
  // Inference with 8-bit weights (model.weight_dtype = "int8" or "fp8"): per id its rows, one byte a weight in format
  // qf, and fp32 row scales, null for a weight held in dt (then in p).
  const uint8_t* const* q8 = nullptr;
  const float* const* s8 = nullptr;
  QFormat qf = QFormat::None;
  const DevLora* lora = nullptr;  // adapters (null: none)
  // Training: fresh[id] = 1 while gradient id (numel[id] F32 elements at g[id]) holds nothing yet this step (DevModel::
  // zero_grads marks them instead of filling). Null: every gradient holds its sum so far.
  uint8_t* fresh = nullptr;
  const int64_t* numel = nullptr;
  // Training: the sums of squares taken of gradients as ops write them fresh (DevModel::take_grad_squares): slot id
  // at sq_sum[id] and sq_bad[id] (device), the span it covers at sq_at[id] (host; null: none). Null: none taken.
  double* sq_sum = nullptr;
  int32_t* sq_bad = nullptr;
  const float** sq_at = nullptr;
};
// The step's first contribution to a weight gradient is written, not added to zeros (accumulate_dW false).
// dev_grad_adds: the accumulate_dW of the op about to produce the gradients `ids` (one op's: a fused pair, a weight
// and its bias): false when all of them are fresh; from then on they add. A mix (never, in practice: a unit is bound
// whole) has its fresh ones zeroed and adds. dev_grad_zeroed: for an op that only adds (norms, scatters, LoRA's
// slices), a fresh gradient zeroed first. Both pass over null (frozen) gradients.
bool dev_grad_adds(const dev::Exec& ex, const DevParams& P, std::initializer_list<int> ids);
void dev_grad_zeroed(const dev::Exec& ex, const DevParams& P, int id);
// For the one op that produces gradient id: its accumulate_dW (dev_grad_adds({id})) and where it takes the gradient's
// sum of squares: slot id when squares are taken and the gradient is written fresh (the slot then covers it), else
// none. Both functions above drop a slot's cover: an add after the write (a second micro-step, a second use) makes
// the sum stale.
struct DevGradOut {
  bool adds = true;
  dev::SumSq sq;
};
DevGradOut dev_grad_out(const dev::Exec& ex, const DevParams& P, int id);
// y[N, n_out] = x[N, n_in] W^T for rows [row0, row0 + n_out) of parameter id (no bias; row0: a vocabulary slice's
// first row), W its 8-bit rows when it has them, else its dt weight. rin (dev::RowsIn) and add (y +=, a residual
// add): the 8-bit path's (dev::linear_q8_fwd).
void dev_linear(const dev::Exec& ex, const DevParams& P, int id, const void* x, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt, int64_t row0 = 0, const dev::RowsIn& rin = {}, bool add = false);

// LoRA adapters at run time (model/lora.hpp's LoraRun on the device): the table that pairs base weights with their
// adapters, the scale and dropout, and scratch carved once: u, du [rows, r] and a dropout buffer [rows * in].
struct DevLora {
  const ParamTable* table = nullptr;
  float scale = 0;
  double dropout = 0;
  bool train = false;            // dropout only while training
  uint64_t seed = 0, nonce = 0;  // the mask's key: lora_dropout_key(seed, nonce, adapter)
  void *u = nullptr, *du = nullptr, *xd = nullptr;
  int64_t rows = 0, elems = 0;   // capacity: rows of u/du, elements of xd
  // The scratch for passes of up to `tokens` text rows and `patches` vision rows (nothing without adapters).
  void carve(Arena& a, const ModelConfig& cfg, int64_t tokens, int64_t patches, DType dt);
};
// y[n*ldy + j] (+)= scale * (B A drop(x))[n, o0 + j] for j < nout (nout < 0: every row of B) when base weight `id`
// has an adapter, else nothing; x [N, in] are rows row0.. of the adapter's input in this pass (their place in the
// dropout mask); y_f32: y is fp32 (the MoE router's logits), else dt. lora_fwd's arithmetic, on the device.
void dev_lora_fwd(const dev::Exec& ex, const DevParams& P, int id, const void* x, int64_t N, void* y, int64_t ldy,
                  DType dt, int64_t o0 = 0, int64_t nout = -1, int64_t row0 = 0, bool y_f32 = false);
// Its backward: dA, dB (+)= their gradients (null: frozen), dx (+)= the input gradient (dx may be null).
void dev_lora_bwd(const dev::Exec& ex, const DevParams& P, int id, const void* dy, int64_t lddy, const void* x,
                  int64_t N, void* dx, DType dt, int64_t o0 = 0, int64_t nout = -1, int64_t row0 = 0);
// Whether base weight `id` has an adapter (dev_lora_fwd and dev_lora_bwd then add to their outputs).
bool dev_lora_on(const DevParams& P, int id);

// The first id of the experts (gate_up; down follows) of the decoder layer whose first id is f: right after the
// router, unless LoRA put the layer unit's adapters in between (adapters go at the end of the unit they wrap, the
// experts are a unit of their own).
int dev_experts_id(const DevParams& P, int f);

// Element offset into a dt array.
inline void* at(void* p, int64_t i, DType t) { return static_cast<char*>(p) + i * int64_t(dtype_size(t)); }
inline const void* at(const void* p, int64_t i, DType t) {
  return static_cast<const char*>(p) + i * int64_t(dtype_size(t));
}

// What a decoder layer's backward needs from its forward (dt arrays unless noted). MoE layers keep the routing and
// the experts' pre-activations; probs/idx are pooled by the caller for the aux loss.
struct DevDecoderCtx {
  void *x, *ln1, *qkv, *q, *k, *v, *att, *x1, *ln2, *gu, *act;  // qkv: the fused projection's rows [q | k | v]
  float *r1, *rq, *rk, *lse, *r2;
  float* w;                      // MoE: [N,k] routing weights
  int32_t *start, *rows, *pos;   // MoE: expert buckets
  void *egu, *ey;                // MoE: [R,2Im] pre-activation (EP: [Ro,2Im]), [R,H] expert outputs
  // Expert parallelism (ex non-null, a group of `ep` ranks): the rows this rank's E/ep experts received, expert-major
  // (xo [Ro,H]; perm [Ro]: each one's row in arrival order; ostart [E/ep+1]), and the dispatch's rows per group rank.
  ExpertExchange* ex = nullptr;
  void* xo = nullptr;
  int32_t *perm = nullptr, *ostart = nullptr;
  int64_t ro = 0, ro_cap = 0;
  std::vector<int64_t> send_rows, recv_rows;
  // Serving with serve.ep (inference, no exchange): this rank holds experts [e0, e0 + el) of the router's E and runs
  // only the rows routed to them; the tensor-parallel sum after the block adds the other ranks' (el = 0: all local).
  int64_t e0 = 0, el = 0;
  void carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt, int ep = 1);
};
// Temporaries of one layer's forward or backward, shared by all layers (not kept).
struct DevDecoderScratch {
  void *tmp, *dln, *dact, *dgu, *datt, *dq, *dk, *dv, *dqkv;  // dqkv: qkv's gradient rows
  void *logits, *xg, *eact, *dyg, *edact, *edgu, *dxg, *dlogits;  // MoE (logits, dlogits: [N,E] F32)
  float* dw;                                                      // MoE: [R]
  void *arr = nullptr, *yo = nullptr;  // expert parallelism: [Ro,H] rows in arrival order, and expert-major
  void carve(Arena& a, const TextConfig& tc, bool moe, int64_t N, DType dt, int ep = 1);
};

// Packed segments on the device: cu [nseg+1] int32 and the longest segment. They cover a pass's rows [0, N) (the
// backward writes the attention's input gradients over them, dev::attention_bwd).
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

// Expert parallelism (DESIGN.md): the experts' part of a MoE block when c.ex splits them over a group, the owners
// running the rows routed to their experts. Forward: s.xg [R,H] (gathered by c.rows, expert-major) -> dispatch ->
// local experts -> combine -> s.tmp [N,H] (N = 0: an idle rank, which only serves the others). Backward: dout [N,H]
// -> c.ey's gradient -> owners -> s.dxg [R,H] (the rows' input gradients in s.xg's order) and s.dw [R]. Every rank
// of the group makes the same exchange calls, whatever its N.
void dev_moe_experts_fwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int first, int64_t N,
                         DevDecoderCtx& c, DevDecoderScratch& s, DType dt);
void dev_moe_experts_bwd(const dev::Exec& ex, const TextConfig& tc, const DevParams& P, int first, const void* dout,
                         int64_t N, DevDecoderCtx& c, DevDecoderScratch& s, DType dt);

// Inference through one layer against a paged KV cache (serve; layers.hpp's decoder_layer_infer on the device): N
// new tokens x[N,H] in place; their keys/values (after QK-norm and RoPE) are written to pool rows slots[N] of
// k_pool/v_pool [rows, nkv, hd] and each attends to its sequence's cache (cache: dev::paged_attention_fwd's
// arguments). Only the forward's buffers of c and s are used, nothing is kept. reduce (may be empty) sums a
// tensor-parallel slice's partial o_proj and MLP outputs [N,H] over the group, in place. Residual adds go with the
// next norm (dev::residual_rmsnorm_fwd): `pending` (may be null) is the previous layer's MLP output, added to x here,
// and this layer leaves its own MLP output in s.tmp, not yet added (the caller adds the last one). Decode-sized steps
// (N <= 16) without tensor parallelism fold instead (Q3VL_DECODE_FOLD=0: never): 8-bit o_proj and dense down_proj
// weights and the MoE combine add their outputs to x themselves (linear_q8_fwd's and moe_combine_fwd's add), and
// 8-bit qkv and dense gate_up weights read x through its norm (dev::RowsIn's norm) when nothing is pending: two norm
// passes fewer a dense layer, one a MoE layer. A dense layer whose o_proj, gate_up and down_proj weights are all
// 8-bit or all in dt runs them so folded as one dev::linear_chain (Q3VL_DECODE_CHAIN=0: never), the next layer's qkv
// with them where `ahead` asks for it. Returns whether the MLP output is in x already (else it is in s.tmp).
struct DevPagedCache {
  void *k, *v;                 // this layer's pools
  const int32_t *slots, *cu, *ctx, *table;
  int64_t max_blocks, block, nseg, max_q, max_ctx, keys;  // keys: the contexts' sum (profiler bytes)
};
using DevPartialSum = std::function<void(void*, int64_t)>;
// A dense layer's decode chain may end with the next layer's qkv projection (weights of the chain's kind): the caller
// sets `next` to that layer's first parameter id where nothing runs between the two layers (else -1);
// dev_decoder_infer sets `ready` where it wrote the next layer's c.qkv, and the next call then starts at its qkv rows.
// With the attention in the chain (dev::ChainAttn) the chains of such layers are one: their links wait in `links`
// (attention arguments in `attn`, chain format qf) and dev_decoder_infer launches them where a layer ends the run
// (not `ready`), where the next layer's links would pass dev::kChainMaxLinks, and before the ops of a layer that does
// not chain. So after a layer that leaves `ready` false, nothing waits.
// Whether decode steps put the attention into their chains (dev::ChainAttn): on at start unless Q3VL_CHAIN_ATTN=0;
// tests set it.
bool& dev_chain_attn();
// Whether one-row decode steps put a MoE layer's block into its chain (dev::ChainMoe; weights in the activations'
// type, no expert parallelism): on at start unless Q3VL_CHAIN_MOE=0 (one 30B-A3B bf16 stream on an H100: 3.9 against
// 4.4 ms a token, docs/perf/2026-12-07-thirtyfifth/callE); tests set it.
bool& dev_chain_moe();
struct DevQkvAhead {
  int next = -1;
  bool ready = false;
  std::vector<dev::ChainLink> links;
  std::deque<dev::ChainAttn> attn;  // stable addresses for links[i].attn
  std::deque<dev::ChainMoe> moe;    // and for links[i].moe
  QFormat qf = QFormat::None;
};
bool dev_decoder_infer(const dev::Exec& ex, const ModelConfig& cfg, const DevParams& P, int first, bool moe, void* x,
                       int64_t N, const DevPagedCache& kv, const float* cos, const float* sin, float* probs,
                       int32_t* idx, DevDecoderCtx& c, DevDecoderScratch& s, const DevPartialSum& reduce,
                       const void* pending, DevQkvAhead& ahead, DType dt);

}  // namespace q3vl
