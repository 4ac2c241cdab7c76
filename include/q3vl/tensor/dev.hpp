// The device op layer (DESIGN.md "Device execution"): every computation of the model as a named op on raw
// pointers with run-time dtypes, executed where an Exec says (the CPU, or a CUDA stream). The CPU implementation
// (src/tensor/dev_cpu.cpp) is the reference: it runs the fp32 ops:: templates. The CUDA one (src/tensor/cuda/)
// is tested against it op by op (tests/unit/test_backend_ops.cpp). Layer code calls these ops only, so it reads the
// same for both.
//
// Conventions, shared by every op:
//  - `dt` is the dtype of activations, their gradients and weights as gathered: F32, BF16 or F16 (the CPU
//    implements F32 only). Math inside a kernel is fp32 whatever dt is.
//  - Weight and bias gradients (dW, db, norm dw, dtable) are F32 and accumulated (+=): they are the ZeRO gradient
//    accumulators. Each may be null (a frozen part): the op then computes only the input gradient.
//  - Backward ops ACCUMULATE (+=) into every gradient output, activations too (as ops:: does); callers zero them.
//    Those with an `accumulate` argument write (=) their input gradients instead when it is false: the value is the
//    accumulated one into a zeroed buffer, bit for bit (0 + v), without the fill or the read. The first op to
//    produce a buffer writes it, the later ones add.
//  - Saved statistics (mean, rstd, lse), rope tables (cos/sin), router probabilities and routing weights are F32.
//  - Indices are int32: token ids, targets (-100 = ignored), cu_seqlens, expert ids, row maps.
//  - Pointers are device pointers (host pointers on the CPU). Ops never allocate, free or synchronise; scratch
//    comes from Exec::ws. Scalars that a step reduces (losses, norms) are accumulated into device memory.
#pragma once
#include <cstddef>
#include <cstdint>

#include "q3vl/core/dtype.hpp"
#include "q3vl/tensor/tensor.hpp"

namespace q3vl::dev {

// Where ops run. On CUDA: the stream, the cuBLASLt handle and a workspace, all owned by the Exec.
struct Exec {
  Device device = Device::CPU;
  void* stream = nullptr;  // cudaStream_t
  void* blas = nullptr;    // cublasLtHandle_t
  void* ws = nullptr;      // device scratch (GEMM workspace, attention dq accumulators, reductions)
  size_t ws_bytes = 0;
  int gpu = 0;             // the device the stream belongs to
};
// GPUs visible to this process (0 in a build without CUDA).
int device_count();
// A CUDA Exec on GPU `gpu` (made the calling thread's current device: the rank's GPU, Placement::gpu) with its own
// stream and `ws_bytes` of workspace; a CPU Exec needs nothing.
Exec make_exec(Device d, size_t ws_bytes = size_t(256) << 20, int gpu = 0);
void destroy_exec(Exec& x);
void synchronize(const Exec& x);
// Makes x's device the calling thread's current one (a thread other than the one that made x enqueues on it).
void bind_thread(const Exec& x);
// Device memory (host memory on the CPU). Used when arenas are sized, never inside a step.
void* alloc(const Exec& x, size_t bytes);
void release(const Exec& x, void* p);
// Copies on the Exec's stream (host<->device, device<->device); to_host waits for completion.
void to_device(const Exec& x, void* dst, const void* src, size_t bytes);
void to_host(const Exec& x, void* dst, const void* src, size_t bytes);
void copy(const Exec& x, void* dst, const void* src, size_t bytes);
// Free and total memory of the device (the CPU: 0 and 0, not tracked here).
void memory_info(const Exec& x, size_t* free_bytes, size_t* total_bytes);
// Graphs (CUDA graphs): the ops enqueued between capture_begin and capture_end are recorded, not run, and then
// replay with one launch; a decode step's ~600 kernel launches cost the host more than the GPU takes to run them.
// A graph replays the same pointers and sizes, so what changes between replays must sit in device buffers.
// capture_begin is false where there are no graphs (the CPU: the caller runs its ops eagerly); capture_end gives the
// graph, or null when an op could not be recorded (the caller then runs eagerly too). While capturing, the stream
// runs nothing: capture_end must follow, exceptions included.
bool capture_begin(const Exec& x);
void* capture_end(const Exec& x);
void graph_launch(const Exec& x, void* g);
void graph_destroy(const Exec& x, void* g);

// Events order two Execs of one device (compute and communication streams): event_record marks the work enqueued on
// x so far; event_wait makes x's later work wait for the mark (on the device: the host goes on). The CPU runs
// everything in program order and has none (null; the calls do nothing).
void* event_create(const Exec& x);
void event_destroy(const Exec& x, void* e);
void event_record(const Exec& x, void* e);
void event_wait(const Exec& x, void* e);
// The host waits until the work an event marks is done.
void event_synchronize(const Exec& x, void* e);
// Timing events (the profiler's, tensor/profile.hpp): recorded with event_record; event_elapsed_ms waits for `b` and
// gives the milliseconds from `a` to `b`. The CPU has none (null, 0).
void* timing_event_create(const Exec& x);
float event_elapsed_ms(const Exec& x, void* a, void* b);

// How a linear reads its input rows (linear_q8_fwd, grouped_linear_fwd, grouped_linear_q8_fwd; the decode fusions of
// the MLP, the MoE block and the norms): as given (the default), gathered (row r is in[rows[r] / div], gather_rows'
// map), the SwiGLU of a [R, 2 n_in] gate|up input (row r: silu(gate) * up rounded to dt, swiglu_fwd's rows), or
// RMS-normalized with weights `norm` [n_in] in dt (row r: rmsnorm_fwd's row of in[r], eps its epsilon; the three
// are exclusive). CUDA's decode GEMV reads through it (no pass that writes the rows and reads them back;
// the SwiGLU only for a few short rows, the norm where x is staged whole: gemv.cuh); every other path (the CPU, fp32,
// the GEMMs of larger R) first writes the rows into scratch ([R, n_in] in dt, required unless the default) and reads
// them there. After the call scratch holds the rows or is untouched: callers must not read it.
struct RowsIn {
  const int32_t* rows = nullptr;
  int64_t div = 1;
  bool swiglu = false;
  void* scratch = nullptr;
  const void* norm = nullptr;
  float eps = 0.f;
};
// The R rows of n_in that r describes, written out: in itself when r is the default, else r.scratch.
const void* rows_in(const Exec& x, const void* in, const RowsIn& r, int64_t R, int64_t n_in, DType dt);

// An attention link of linear_chain (a decode step's attention, between the qkv projection and o_proj): the
// link's `in` are the fused projection rows [N, (nh + 2 nkv) hd], its y the attention rows [N, nh hd]; it is
// qkv_to_cache_fwd(in -> q, the pools at slots) and then paged_attention_fwd(q -> y), with those ops' arguments
// (q: scratch [N, nh hd] in dt for them). CUDA's chain kernel never writes q (chain_attn.cuh).
struct ChainAttn {
  const void *wq = nullptr, *wk = nullptr;  // q_norm, k_norm [hd]
  const float *cos = nullptr, *sin = nullptr;
  void *k_pool = nullptr, *v_pool = nullptr;
  const int32_t *slots = nullptr, *cu = nullptr, *ctx = nullptr, *table = nullptr;
  int64_t max_blocks = 0, block = 0, nseg = 0, max_q = 0, max_ctx = 0, keys = 0, nh = 0, nkv = 0, hd = 0;
  double eps = 0;
  float scale = 0;
  void* q = nullptr;
};
// A MoE link of linear_chain (a decode step's MoE block, dev_decoder_infer's, without expert parallelism): the
// link's `in` x [N, H] read through its rin (the post-attention norm; rin.scratch [N, H] required), its y [N, H] added
// to (add) or written; it is moe_route (of the norm's rows) -> the experts' gate_up of the routed rows (egu) -> the
// experts' down_proj of their SwiGLU (ey) -> moe_combine_fwd into y, with those ops' arguments (the rest: scratch for
// them). Weights in the activations' type. CUDA's chain kernel (one row) runs it as three of its links: the router's fp32 logits, then,
// every block routing them itself, gate_up of the 8 picked experts' rows writing silu(gate) * up * the pick's weight
// (rounded to dt) into act, then down_proj over the picks' rows as one product of k I columns adding to y; it writes
// idx and w (not probs, start, rows, pos, xg, egu, ey or the norm's rows).
struct ChainMoe {
  const void *router = nullptr, *gate_up = nullptr, *down = nullptr;  // [E, H], [E, 2 I, H], [E, H, I]
  int64_t E = 0, k = 0, I = 0;
  float *logits = nullptr, *probs = nullptr, *w = nullptr;  // [N, E] fp32 x 2, [N, k]
  int32_t *idx = nullptr, *start = nullptr, *rows = nullptr, *pos = nullptr;  // [N, k], [E + 1], [N k], [N k]
  void *xg = nullptr, *egu = nullptr, *act = nullptr, *ey = nullptr;  // [N k, H], [N k, 2 I], [N k, I], [N k, H]
};
// One link of linear_chain: a product y[N, n_out] (+)= (rows of in through rin) W^T (* scale: 8-bit W),
// linear_q8_fwd's or linear_fwd's arguments without a bias; or, attn set, an attention (ChainAttn: in and y only);
// or, moe set, a MoE block (ChainMoe: in, y, n_in = n_out = H, rin, add).
// A link may read what an earlier link of its chain wrote. swiglu_pair: the next link reads this one's y through
// its SwiGLU (rin.swiglu, rin.scratch [N, n_out / 2], in = y; W's rows gate then up, no add): CUDA's chain kernel
// then writes silu(gate) * up into that scratch in place of y, and the next link reads the scratch as it is (the
// MLP's gate_up and down_proj: each block stages half the row and computes no SwiGLU); elsewhere it changes nothing.
struct ChainLink {
  const void* in = nullptr;
  const void* W = nullptr;      // 8-bit of the chain's format, or in the activations' type (QFormat::None)
  const float* scale = nullptr;  // 8-bit W's, F32 [n_out]
  void* y = nullptr;
  int64_t n_in = 0, n_out = 0;
  RowsIn rin;
  bool add = false;
  const ChainAttn* attn = nullptr;
  bool swiglu_pair = false;
  const ChainMoe* moe = nullptr;
};

// A batch of `count` linears of one shape (linear_fwd_batched, linear_bwd_batched): problem j < count reads
// in + j*in, W + j*W, b + j*b and writes y + j*y, the strides in elements; its gradients sit at the same strides as
// what they are the gradient of (dy as y, din as in, dW as W, db as b, the last two in F32 elements). A stride of 0
// shares the operand among the problems, and then its gradient is the sum of theirs: the fused qkv projection is
// three problems on one input (in = 0) with three row blocks of one weight (W = D*D, b = D) writing the [3][N][D]
// block q | k | v (y = N*D). Every written operand (y; din, dW, db where not shared) needs a stride that keeps the
// problems apart: 0 only with count 1, else at least the problem's extent (N*n_out for y, N*n_in for din, ...).
struct LinearBatch {
  int64_t count = 1;
  int64_t in = 0, W = 0, b = 0, y = 0;
};

// Where an op that writes a weight gradient also adds the gradient's sum of squares (sum_squares' two outputs: the
// squares of the finite elements to *sum, the count of the others to *nonfinite, which may be null); sum null: not
// taken. The training step's gradient norm then need not read that gradient again (DevModel::take_grad_squares).
struct SumSq {
  double* sum = nullptr;
  int32_t* nonfinite = nullptr;
};

#include "q3vl/tensor/dev_ops.inc"

// The links of a chain in turn over N rows: linear_q8_fwd (weights of format qf) or, qf None, linear_fwd (weights in
// dt) of each product, and each attention link's two ops (ChainAttn); the CPU runs exactly that. On CUDA,
// decode-sized N of 16-bit activations runs the chain as one persistent kernel where every link fits it
// (gemv_chain.cuh: one TMA ring streams every product's weights, a grid barrier between links; chain_attn.cuh),
// else the links one by one as here.
void linear_chain(const Exec& x, const ChainLink* links, int count, int64_t N, QFormat qf, DType dt);
// An attention link (attn set) as its two ops, qkv_to_cache_fwd and paged_attention_fwd: linear_chain's fallback, and
// the decode step's attention where the chain's attention link is off (Q3VL_CHAIN_ATTN=0).
void chain_attn_ops(const Exec& x, const ChainLink& l, int64_t N, DType dt);
// A MoE link (moe set) as its ops (ChainMoe): linear_chain's fallback and the CPU's.
void chain_moe_ops(const Exec& x, const ChainLink& l, int64_t N, DType dt);
constexpr int kChainMaxLinks = 64;  // links a chain kernel takes (more: the links one by one)
constexpr int kChainMoeJobs = 3;    // a MoE link's jobs of it: the router, the picks' gate_up, their down_proj

}  // namespace q3vl::dev
