// The device op layer's public entry points. Each op forwards to its CUDA launcher when the Exec is on a GPU and
// otherwise runs the CPU reference: the fp32 ops:: templates (the same code the double gradient checks run), so the
// CUDA kernels are tested against exactly what the CPU model computes.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef __SSE2__
#include <immintrin.h>
#endif

#include "q3vl/core/error.hpp"
#include "q3vl/core/hash.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/tensor/dev_host.hpp"
#include "q3vl/tensor/dev_stream.hpp"
#include "q3vl/tensor/ops.hpp"
#include "q3vl/tensor/profile.hpp"

#ifdef Q3VL_CUDA
#include "tensor/cuda/dev_cuda.hpp"
#define ON_CUDA(x, call) \
  if ((x).device == Device::CUDA) return cuda::call
#else
#define ON_CUDA(x, call) \
  if ((x).device == Device::CUDA) fail("this q3vl was built without CUDA (make CUDA=1)")
#endif

// The profiler's hook (tensor/profile.hpp), in front of every op: off, one predictable branch here and one as the op
// returns; on, the op is timed under its own name (__func__) with its cost, whichever device runs it.
#define PROFILED_IF(cond, ...)            \
  prof::Scope prof_scope_;                \
  if (prof::on() && (cond)) [[unlikely]] \
  prof_scope_.begin(__VA_ARGS__)
#define PROFILED(...) PROFILED_IF(true, __VA_ARGS__)
#define DEV_OP(x, cost, call) \
  PROFILED(x, __func__, cost); \
  ON_CUDA(x, call)

namespace q3vl::dev {

namespace {
// Bytes of n elements of t (the profiler's byte counts).
double B(int64_t n, DType t) { return double(n) * double(dtype_size(t)); }
// Attention's FLOPs (QK^T and PV, 2 each per multiply-add) as if every segment were max_len long: exact for packs
// of equal segments (the benchmarks' shapes), an upper bound otherwise (the lengths are on the device). Causal: half.
double attention_flops(int64_t N, int64_t max_len, int64_t nh, int64_t hd, bool causal) {
  return 4.0 * double(N) * double(max_len) * double(nh) * double(hd) * (causal ? 0.5 : 1.0);
}
// y = the product that fn writes into its argument, or with add y += it (the product in a temporary first: the
// linears' residual add, as axpy of the product would).
template <class Fn> void into_or_add(float* y, int64_t n, bool add, Fn&& fn) {
  if (!add) return fn(y);
  std::vector<float> prod(size_t(std::max<int64_t>(n, 0)));
  fn(prod.data());
  for (size_t i = 0; i < prod.size(); ++i) y[i] += prod[i];
}
// The CPU reference computes in fp32 only; a bf16/fp16 model runs on the GPU.
void need_f32(DType dt, const char* op) {
  if (dt != DType::F32)
    fail(std::string("dev::") + op + ": the CPU implementation takes fp32, not " + dtype_name(dt) +
         " (bf16/fp16 compute needs model.backend = \"cuda\")");
}
const float* F(const void* p) { return static_cast<const float*>(p); }
// sum_squares' arithmetic: the squares of a's finite elements summed in order in double into *acc, the count of the
// others into *nonfinite (may be null).
void add_squares(const float* a, int64_t n, double* acc, int32_t* nonfinite) {
  double s = 0;
  int32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = a[i];
    if (std::isfinite(v)) s += double(v) * v; else ++bad;
  }
  *acc += s;
  if (nonfinite) *nonfinite += bad;
}
// f(rows) with 8-bit weights q as the type their format widens from (int8_t, Fp8E4M3).
template <class Fn>
void by_qformat(QFormat qf, const void* q, Fn&& f) {
  if (qf == QFormat::Int8) return f(static_cast<const int8_t*>(q));
  if (qf == QFormat::Fp8) return f(static_cast<const Fp8E4M3*>(q));
  fail("dev: 8-bit weights are int8 or fp8 (model.weight_dtype)");
}
float* F(void* p) { return static_cast<float*>(p); }
// fp32 into dt: a copy (F32), or rounded to nearest even (BF16, F16). convert's, and AdamW's parameter copy's, so the
// two give the same bits.
void narrow(const float* src, int64_t n, void* dst, DType dt) {
  auto* d16 = static_cast<uint16_t*>(dst);
  if (dt == DType::F32) std::memmove(dst, src, size_t(n) * 4);
  else if (dt == DType::BF16) f32_to_bf16(src, n, d16);
  else std::transform(src, src + n, d16, [](float v) { return f32_to_f16(v); });
}
// dst[i] = src[rows[i] / div] for rows of D (gather_rows, and the rows a RowsIn gathers).
void copy_rows(const float* src, const int32_t* rows, int64_t div, float* dst, int64_t R, int64_t D) {
  for (int64_t i = 0; i < R; ++i) std::copy_n(src + rows[i] / div * D, D, dst + i * D);
}
// dst[r, :cols] = src[r, :cols], rows lds and ldd apart.
void ops_copy_2d(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * lds, cols, dst + r * ldd);
}
// ops:: takes int64 indices; the device layer int32 (half the bytes on the GPU). Small arrays, converted per call.
std::vector<int64_t> widen(const int32_t* p, int64_t n) { return std::vector<int64_t>(p, p + n); }
// An input gradient that an op writes (accumulate = false): zeroed, then accumulated into by ops::, which is what the
// caller's fill and the accumulating op computed.
void clear_unless(bool accumulate, void* p, int64_t n) {
  if (!accumulate && p) std::fill(F(p), F(p) + n, 0.f);
}
}  // namespace

int device_count() {
#ifdef Q3VL_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

namespace {
Exec exec_of(Device d, size_t ws_bytes, int gpu, bool high) {
  if (d == Device::CPU) return Exec{};
#ifdef Q3VL_CUDA
  return high ? cuda::make_priority_exec(ws_bytes, gpu) : cuda::make_exec(ws_bytes, gpu);
#else
  (void)ws_bytes, (void)gpu, (void)high;
  fail("this q3vl was built without CUDA (make CUDA=1)");
#endif
}
}  // namespace

Exec make_exec(Device d, size_t ws_bytes, int gpu) { return exec_of(d, ws_bytes, gpu, false); }
Exec make_priority_exec(Device d, size_t ws_bytes, int gpu) { return exec_of(d, ws_bytes, gpu, true); }
void destroy_exec(Exec& x) { ON_CUDA(x, destroy_exec(x)); }
void synchronize(const Exec& x) {
  PROFILED_IF(x.device == Device::CUDA, Exec{}, "synchronize", {}, prof::Kind::HostWait);
  ON_CUDA(x, synchronize(x));
}
void bind_thread(const Exec& x) { ON_CUDA(x, bind_thread(x)); }
void* alloc(const Exec& x, size_t bytes) {
  ON_CUDA(x, alloc(x, bytes));
  void* p = std::calloc(1, bytes ? bytes : 1);
  if (!p) fail("dev::alloc: out of host memory for " + std::to_string(bytes) + " bytes");
  return p;
}
void release(const Exec& x, void* p) {
  ON_CUDA(x, release(x, p));
  std::free(p);
}
void to_device(const Exec& x, void* dst, const void* src, size_t bytes) {
  PROFILED(x, "to_device", prof::mem(double(bytes)), prof::Kind::Copy);
  ON_CUDA(x, to_device(x, dst, src, bytes));
  std::memcpy(dst, src, bytes);
}
void to_host(const Exec& x, void* dst, const void* src, size_t bytes) {
  const bool cuda = x.device == Device::CUDA;  // the host waits for the copy: on CUDA that wait is the row
  PROFILED(cuda ? Exec{} : x, "to_host", prof::mem(double(bytes)), cuda ? prof::Kind::HostWait : prof::Kind::Copy);
  ON_CUDA(x, to_host(x, dst, src, bytes));
  std::memcpy(dst, src, bytes);
}
void copy(const Exec& x, void* dst, const void* src, size_t bytes) {
  PROFILED(x, "copy", prof::mem(2.0 * double(bytes)), prof::Kind::Copy);
  ON_CUDA(x, copy(x, dst, src, bytes));
  std::memmove(dst, src, bytes);
}
void* host_alloc(const Exec& x, size_t bytes) {
  ON_CUDA(x, host_alloc(bytes));
  const size_t n = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, n);
  if (!p) fail("dev::host_alloc: out of host memory for " + std::to_string(bytes) + " bytes");
  std::memset(p, 0, n);
  return p;
}
void host_release(const Exec& x, void* p) {
  ON_CUDA(x, host_release(p));
  std::free(p);
}
void host_register(const Exec& x, void* p, size_t bytes) { ON_CUDA(x, host_register(p, bytes)); }
void host_unregister(const Exec& x, void* p) { ON_CUDA(x, host_unregister(p)); }
void to_host_async(const Exec& x, void* dst, const void* src, size_t bytes) {
  PROFILED(x, "to_host_async", prof::mem(double(bytes)), prof::Kind::Copy);
  ON_CUDA(x, to_host_async(x, dst, src, bytes));
  std::memcpy(dst, src, bytes);
}

bool capture_begin(const Exec& x) {
  ON_CUDA(x, capture_begin(x));
  return false;
}
void* capture_end(const Exec& x) {
  ON_CUDA(x, capture_end(x));
  return nullptr;
}
void graph_launch(const Exec& x, void* g) {
  ON_CUDA(x, graph_launch(x, g));
  fail("dev::graph_launch: the CPU has no graphs");
}
void graph_destroy(const Exec& x, void* g) { ON_CUDA(x, graph_destroy(g)); }

void* event_create(const Exec& x) {
  ON_CUDA(x, event_create(x));
  return nullptr;
}
void event_destroy(const Exec& x, void* e) { ON_CUDA(x, event_destroy(e)); }
void event_record(const Exec& x, void* e) { ON_CUDA(x, event_record(x, e)); }
// Profiled on CUDA: the time the stream stood still at the wait (events before and after it on x's stream).
void event_wait(const Exec& x, void* e) {
  PROFILED_IF(x.device == Device::CUDA, x, "event_wait", {}, prof::Kind::StreamWait);
  ON_CUDA(x, event_wait(x, e));
}
void event_synchronize(const Exec& x, void* e) {
  PROFILED_IF(x.device == Device::CUDA, Exec{}, "event_synchronize", {}, prof::Kind::HostWait);
  ON_CUDA(x, event_synchronize(e));
}
void* timing_event_create(const Exec& x) {
  ON_CUDA(x, timing_event_create(x));
  return nullptr;
}
float event_elapsed_ms(const Exec& x, void* a, void* b) {
  ON_CUDA(x, event_elapsed_ms(a, b));
  return 0;
}

void memory_info(const Exec& x, size_t* free_bytes, size_t* total_bytes) {
  ON_CUDA(x, memory_info(x, free_bytes, total_bytes));
  *free_bytes = *total_bytes = 0;
}

// ---- elementwise and conversions ------------------------------------------------------------------------------
void fill(const Exec& x, void* p, DType t, int64_t n, float value) {
  DEV_OP(x, prof::mem(B(n, t)), fill(x, p, t, n, value));
  need_f32(t, "fill");
  std::fill(F(p), F(p) + n, value);
}
void convert(const Exec& x, void* dst, DType dt_dst, const void* src, DType dt_src, int64_t n) {
  DEV_OP(x, prof::mem(B(n, dt_src) + B(n, dt_dst)), convert(x, dst, dt_dst, src, dt_src, n));
  if (dt_dst == dt_src) return (void)std::memmove(dst, src, size_t(n) * dtype_size(dt_src));
  // The host side of gathers and checkpoints: fp32 <-> bf16/fp16 with round-to-nearest-even.
  auto* s16 = static_cast<const uint16_t*>(src);
  if (dt_src == DType::F32 && (dt_dst == DType::BF16 || dt_dst == DType::F16)) return narrow(F(src), n, dst, dt_dst);
  if (dt_src == DType::BF16 && dt_dst == DType::F32) return bf16_to_f32(s16, n, F(dst));
  if (dt_src == DType::F16 && dt_dst == DType::F32)
    return (void)std::transform(s16, s16 + n, F(dst), [](uint16_t v) { return f16_to_f32(v); });
  fail(std::string("dev::convert: ") + dtype_name(dt_src) + " -> " + dtype_name(dt_dst) + " is not supported");
}
void axpy(const Exec& x, float alpha, const void* a, void* y, int64_t n, DType dt) {
  DEV_OP(x, prof::mem(3 * B(n, dt)), axpy(x, alpha, a, y, n, dt));
  need_f32(dt, "axpy");
  for (int64_t i = 0; i < n; ++i) F(y)[i] += alpha * F(a)[i];
}
void scale(const Exec& x, void* y, int64_t n, float alpha, DType dt) {
  DEV_OP(x, prof::mem(2 * B(n, dt)), scale(x, y, n, alpha, dt));
  need_f32(dt, "scale");
  for (int64_t i = 0; i < n; ++i) F(y)[i] *= alpha;
}
void dropout_fwd(const Exec& x, const void* in, void* y, int64_t n, double p, uint64_t key, int64_t first, DType dt) {
  DEV_OP(x, prof::mem(2 * B(n, dt)), dropout_fwd(x, in, y, n, p, key, first, dt));
  need_f32(dt, "dropout_fwd");
  const float keep = float(1 / (1 - p));
  for (int64_t i = 0; i < n; ++i) F(y)[i] = dropout_drops(key, first + i, p) ? 0.f : F(in)[i] * keep;
}
void dropout_bwd(const Exec& x, const void* dy, void* dx, int64_t n, double p, uint64_t key, int64_t first, DType dt) {
  DEV_OP(x, prof::mem(3 * B(n, dt)), dropout_bwd(x, dy, dx, n, p, key, first, dt));
  need_f32(dt, "dropout_bwd");
  const float keep = float(1 / (1 - p));
  for (int64_t i = 0; i < n; ++i)
    if (!dropout_drops(key, first + i, p)) F(dx)[i] += F(dy)[i] * keep;
}

// ---- GEMM ---------------------------------------------------------------------------------------------------------
void gemm(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct) {
  DEV_OP(x, prof::flop(2.0 * double(M) * double(N) * double(K)), gemm(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct));
  need_f32(dt, "gemm");
  need_f32(ct, "gemm");
  ops::gemm<float>(ta, tb, M, N, K, alpha, F(A), lda, F(B), ldb, beta, F(C), ldc);
}
void linear_fwd(const Exec& x, const void* in, const void* W, const void* b, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt, const RowsIn& rin, bool add) {
  PROFILED(x, prof::shaped(__func__, N, n_in, n_out), prof::flop(2.0 * double(N) * double(n_in) * double(n_out)));
  ON_CUDA(x, linear_fwd(x, in, W, b, y, N, n_in, n_out, dt, rin, add));
  need_f32(dt, "linear_fwd");
  in = rows_in(x, in, rin, N, n_in, dt);
  into_or_add(F(y), N * n_out, add, [&](float* out) { ops::linear_fwd(F(in), F(W), F(b), out, N, n_in, n_out); });
}
const void* rows_in(const Exec& x, const void* in, const RowsIn& r, int64_t R, int64_t n_in, DType dt) {
  if (!r.rows && !r.swiglu && !r.norm) return in;
  Q3VL_CHECK(r.scratch && int(r.rows != nullptr) + int(r.swiglu) + int(r.norm != nullptr) == 1,
             "dev::RowsIn: one of rows, swiglu and norm, with a scratch buffer");
  // Called inside the ops that take a RowsIn: their profiled region covers this pass, so the ops are not re-entered.
#ifdef Q3VL_CUDA
  if (x.device == Device::CUDA) {
    if (r.rows) cuda::gather_rows(x, in, r.rows, r.div, r.scratch, R, n_in, dt);
    else if (r.swiglu) cuda::swiglu_fwd(x, in, r.scratch, R, n_in, dt);
    else cuda::rmsnorm_fwd(x, in, r.norm, r.scratch, nullptr, R, n_in, r.eps, dt);
    return r.scratch;
  }
#endif
  need_f32(dt, "rows_in");
  float* out = static_cast<float*>(r.scratch);
  if (r.swiglu) {
    ops::swiglu_fwd(F(in), out, R, n_in);
  } else if (r.norm) {
    std::vector<float> rstd(size_t(std::max<int64_t>(R, 0)));
    ops::rmsnorm_fwd(F(in), F(r.norm), out, rstd.data(), R, n_in, r.eps);
  } else {
    copy_rows(F(in), r.rows, r.div, out, R, n_in);
  }
  return out;
}

void linear_q8_fwd(const Exec& x, const void* in, const void* q, const float* scale, const void* b, void* y, int64_t N,
                   int64_t n_in, int64_t n_out, QFormat qf, DType dt, const RowsIn& rin, bool add) {
  PROFILED(x, prof::shaped(__func__, N, n_in, n_out), prof::flop(2.0 * double(N) * double(n_in) * double(n_out)));
  ON_CUDA(x, linear_q8_fwd(x, in, q, scale, b, y, N, n_in, n_out, qf, dt, rin, add));
  need_f32(dt, "linear_q8_fwd");
  in = rows_in(x, in, rin, N, n_in, dt);
  into_or_add(F(y), N * n_out, add, [&](float* out) {
    by_qformat(qf, q, [&](const auto* w) { ops::linear_lowp_fwd(F(in), w, scale, F(b), out, N, n_in, n_out); });
  });
}
void linear_chain(const Exec& x, const ChainLink* links, int count, int64_t N, QFormat qf, DType dt) {
  double flop = 0;
  for (int j = 0; j < count; ++j) {
    const ChainLink& l = links[j];
    flop += l.attn  ? attention_flops(N, l.attn->max_ctx, l.attn->nh, l.attn->hd, false)
            : l.moe ? 2.0 * double(N) * double(l.n_in) * double(l.moe->E + 3 * l.moe->k * l.moe->I)
                    : 2.0 * double(N) * double(l.n_in) * double(l.n_out);
  }
  PROFILED(x, __func__, prof::flop(flop));  // the links' ops below are inside this region, not timed apart
#ifdef Q3VL_CUDA
  if (x.device == Device::CUDA && cuda::linear_chain_kernel(x, links, count, N, qf, dt)) return;
#endif
  for (int j = 0; j < count; ++j) {  // the links one by one
    const ChainLink& l = links[j];
    if (l.attn || l.moe) {  // a chain of its own where it can
#ifdef Q3VL_CUDA
      if (count > 1 && x.device == Device::CUDA && cuda::linear_chain_kernel(x, &l, 1, N, qf, dt)) continue;
#endif
      if (l.attn) chain_attn_ops(x, l, N, dt);
      else chain_moe_ops(x, l, N, dt);
    } else if (qf == QFormat::None) {
      linear_fwd(x, l.in, l.W, nullptr, l.y, N, l.n_in, l.n_out, dt, l.rin, l.add);
    } else {
      linear_q8_fwd(x, l.in, l.W, l.scale, nullptr, l.y, N, l.n_in, l.n_out, qf, dt, l.rin, l.add);
    }
  }
}
void chain_attn_ops(const Exec& x, const ChainLink& l, int64_t N, DType dt) {
  const ChainAttn& a = *l.attn;
  qkv_to_cache_fwd(x, l.in, a.wq, a.wk, a.q, a.k_pool, a.v_pool, a.slots, nullptr, nullptr, a.cos, a.sin, N, a.nh,
                   a.nkv, a.hd, a.eps, dt);
  paged_attention_fwd(x, a.q, a.k_pool, a.v_pool, l.y, a.cu, a.ctx, a.table, a.max_blocks, a.block, a.nseg, a.max_q,
                      a.max_ctx, a.keys, N, a.nh, a.nkv, a.hd, a.scale, dt);
}
void chain_moe_ops(const Exec& x, const ChainLink& l, int64_t N, DType dt) {
  const ChainMoe& m = *l.moe;
  const int64_t H = l.n_in, R = N * m.k;
  Q3VL_CHECK(l.n_out == H && !l.rin.rows && !l.rin.swiglu, "dev::chain_moe_ops: bad MoE link");
  const void* xn = rows_in(x, l.in, l.rin, N, H, dt);
  moe_route(x, xn, m.router, m.logits, m.probs, m.idx, m.w, m.start, m.rows, m.pos, N, H, m.E, m.k, dt);
  grouped_linear_fwd(x, xn, m.gate_up, m.start, m.egu, R, m.E, H, 2 * m.I, dt, {m.rows, m.k, false, m.xg});
  grouped_linear_fwd(x, m.egu, m.down, m.start, m.ey, R, m.E, m.I, H, dt, {nullptr, 1, true, m.act});
  moe_combine_fwd(x, m.ey, m.pos, m.w, l.y, N, m.k, H, dt, l.add);
}
void linear_bwd(const Exec& x, const void* dy, const void* in, const void* W, void* din, float* dW, float* db,
                int64_t N, int64_t n_in, int64_t n_out, bool accumulate, bool accumulate_dW, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, n_in, n_out),
           prof::flop(2.0 * double(N) * double(n_in) * double(n_out) * ((din ? 1 : 0) + (dW ? 1 : 0))));
  ON_CUDA(x, linear_bwd(x, dy, in, W, din, dW, db, N, n_in, n_out, accumulate, accumulate_dW, dt));
  need_f32(dt, "linear_bwd");
  clear_unless(accumulate, din, N * n_in);
  clear_unless(accumulate_dW, dW, n_out * n_in);
  clear_unless(accumulate_dW, db, n_out);
  ops::linear_bwd(F(dy), F(in), F(W), F(din), dW, db, N, n_in, n_out);
}

namespace {
// linear_*_batched's strides (dev.hpp's LinearBatch): none negative, and each written operand's (y forward; din, dW,
// db backward, where not shared) far enough apart that no two problems write one element.
void check_batch(const char* op, const LinearBatch& bt, int64_t N, int64_t n_in, int64_t n_out, bool fwd,
                 bool din, bool dW, bool db) {
  const std::string what = std::string("dev::") + op + ": ";
  Q3VL_CHECK(bt.count >= 0 && bt.in >= 0 && bt.W >= 0 && bt.b >= 0 && bt.y >= 0,
             what + "negative batch count or stride");
  if (bt.count <= 1) return;
  auto apart = [&](bool written, int64_t stride, int64_t extent, const char* name) {
    Q3VL_CHECK(!written || stride >= extent,
               what + name + "'s batch stride " + std::to_string(stride) + " overlaps its problems of " +
                   std::to_string(extent) + " elements");
  };
  if (fwd) {
    apart(true, bt.y, N * n_out, "y");
  } else {
    apart(din && bt.in != 0, bt.in, N * n_in, "din");
    apart(dW && bt.W != 0, bt.W, n_out * n_in, "dW");
    apart(db && bt.b != 0, bt.b, n_out, "db");
  }
}
}  // namespace

void linear_fwd_batched(const Exec& x, const void* in, const void* W, const void* b, void* y, int64_t N, int64_t n_in,
                        int64_t n_out, const LinearBatch& bt, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, n_in, n_out, bt.count),
           prof::flop(2.0 * double(bt.count) * double(N) * double(n_in) * double(n_out)));
  check_batch(__func__, bt, N, n_in, n_out, true, false, false, false);
  ON_CUDA(x, linear_fwd_batched(x, in, W, b, y, N, n_in, n_out, bt, dt));
  need_f32(dt, "linear_fwd_batched");
  for (int64_t j = 0; j < bt.count; ++j)  // linear_fwd on each problem: the same bits
    ops::linear_fwd(F(in) + j * bt.in, F(W) + j * bt.W, b ? F(b) + j * bt.b : nullptr, F(y) + j * bt.y, N, n_in,
                    n_out);
}
void linear_bwd_batched(const Exec& x, const void* dy, const void* in, const void* W, void* din, float* dW, float* db,
                        int64_t N, int64_t n_in, int64_t n_out, const LinearBatch& bt, bool accumulate,
                        bool accumulate_dW, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, n_in, n_out, bt.count),
           prof::flop(2.0 * double(bt.count) * double(N) * double(n_in) * double(n_out) *
                      ((din ? 1 : 0) + (dW ? 1 : 0))));
  check_batch(__func__, bt, N, n_in, n_out, false, din != nullptr, dW != nullptr, db != nullptr);
  ON_CUDA(x, linear_bwd_batched(x, dy, in, W, din, dW, db, N, n_in, n_out, bt, accumulate, accumulate_dW, dt));
  need_f32(dt, "linear_bwd_batched");
  // linear_bwd on each problem in turn: a shared operand's gradient (stride 0) is written by the first (unless
  // accumulated) and added to by the rest, as separate calls would.
  for (int64_t j = 0; j < bt.count; ++j) {
    float* dinj = din ? F(din) + j * bt.in : nullptr;
    float* dWj = dW ? dW + j * bt.W : nullptr;
    float* dbj = db ? db + j * bt.b : nullptr;
    clear_unless(accumulate || (j > 0 && bt.in == 0), dinj, N * n_in);
    clear_unless(accumulate_dW || (j > 0 && bt.W == 0), dWj, n_out * n_in);
    clear_unless(accumulate_dW || (j > 0 && bt.b == 0), dbj, n_out);
    ops::linear_bwd(F(dy) + j * bt.y, F(in) + j * bt.in, F(W) + j * bt.W, dinj, dWj, dbj, N, n_in, n_out);
  }
}

// ---- norms ------------------------------------------------------------------------------------------------------------
void residual_rmsnorm_fwd(const Exec& x, const void* a, void* io, const void* w, void* y, void* saved, float* rstd,
                          int64_t N, int64_t D, double eps, DType dt) {
  DEV_OP(x, prof::mem((2 + (a ? 2 : 0) + (saved ? 1 : 0)) * B(N * D, dt)),
         residual_rmsnorm_fwd(x, a, io, w, y, saved, rstd, N, D, eps, dt));
  if (a) axpy(x, 1.f, a, io, N * D, dt);
  if (saved) copy(x, saved, io, size_t(N * D) * dtype_size(dt));
  rmsnorm_fwd(x, io, w, y, rstd, N, D, eps, dt);
}
void qk_norm_rope_fwd(const Exec& x, const void* qraw, const void* kraw, const void* wq, const void* wk, void* q,
                      void* k, float* rq, float* rk, const float* cos, const float* sin, int64_t N, int64_t nh,
                      int64_t nkv, int64_t hd, double eps, DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * (nh + nkv) * hd, dt)), qk_norm_rope_fwd(x, qraw, kraw, wq, wk, q, k, rq, rk, cos, sin, N, nh, nkv, hd, eps, dt));
  rmsnorm_fwd(x, qraw, wq, q, rq, N * nh, hd, eps, dt);
  rmsnorm_fwd(x, kraw, wk, k, rk, N * nkv, hd, eps, dt);
  rope_fwd(x, q, cos, sin, N, nh, hd, dt);
  rope_fwd(x, k, cos, sin, N, nkv, hd, dt);
}
void qk_norm_rope_bwd(const Exec& x, void* dq, void* dk, const void* qraw, const void* kraw, const void* wq,
                      const void* wk, const float* rq, const float* rk, const float* cos, const float* sin, void* dqr,
                      void* dkr, float* dwq, float* dwk, int64_t N, int64_t nh, int64_t nkv, int64_t hd, int64_t ld,
                      bool accumulate, DType dt) {
  DEV_OP(x, prof::mem((3 + (accumulate ? 1 : 0)) * B(N * (nh + nkv) * hd, dt)),
         qk_norm_rope_bwd(x, dq, dk, qraw, kraw, wq, wk, rq, rk, cos, sin, dqr, dkr, dwq, dwk, N, nh, nkv, hd, ld,
                          accumulate, dt));
  need_f32(dt, "qk_norm_rope_bwd");
  rope_bwd(x, dq, cos, sin, N, nh, hd, dt);
  rope_bwd(x, dk, cos, sin, N, nkv, hd, dt);
  // Strided rows (training's fused q | k | v) through contiguous copies: the reference's arithmetic is unchanged.
  const int64_t Dq = nh * hd, Dk = nkv * hd;
  if (ld == 0 || (ld == Dq && ld == Dk)) {
    rmsnorm_bwd(x, dq, qraw, wq, rq, dqr, dwq, N * nh, hd, accumulate, dt);
    rmsnorm_bwd(x, dk, kraw, wk, rk, dkr, dwk, N * nkv, hd, accumulate, dt);
    return;
  }
  const auto kind = [&](const void* d, const void* xin, const void* w, const float* r, void* dx, float* dw, int64_t D) {
    std::vector<float> xc(N * D), dxc(N * D);
    ops_copy_2d(F(xin), ld, xc.data(), D, N, D);
    if (accumulate) ops_copy_2d(F(dx), ld, dxc.data(), D, N, D);
    rmsnorm_bwd(x, d, xc.data(), w, r, dxc.data(), dw, N * (D / hd), hd, accumulate, dt);
    ops_copy_2d(dxc.data(), D, F(dx), ld, N, D);
  };
  kind(dq, qraw, wq, rq, dqr, dwq, Dq);
  kind(dk, kraw, wk, rk, dkr, dwk, Dk);
}
void qkv_to_cache_fwd(const Exec& x, const void* qkv, const void* wq, const void* wk, void* q, void* k_pool,
                      void* v_pool, const int32_t* slots, float* rq, float* rk, const float* cos, const float* sin,
                      int64_t N, int64_t nh, int64_t nkv, int64_t hd, double eps, DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * (nh + 2 * nkv) * hd, dt)), qkv_to_cache_fwd(x, qkv, wq, wk, q, k_pool, v_pool, slots, rq, rk, cos, sin, N, nh, nkv, hd, eps, dt));
  need_f32(dt, "qkv_to_cache_fwd");
  const int64_t Dq = nh * hd, Dk = nkv * hd, ld = Dq + 2 * Dk;
  std::vector<float> qr(N * Dq), kr(N * Dk), v(N * Dk), k(N * Dk), rqs(N * nh), rks(N * nkv);
  ops_copy_2d(F(qkv), ld, qr.data(), Dq, N, Dq);
  ops_copy_2d(F(qkv) + Dq, ld, kr.data(), Dk, N, Dk);
  ops_copy_2d(F(qkv) + Dq + Dk, ld, v.data(), Dk, N, Dk);
  qk_norm_rope_fwd(x, qr.data(), kr.data(), wq, wk, q, k.data(), rq ? rq : rqs.data(), rk ? rk : rks.data(), cos,
                   sin, N, nh, nkv, hd, eps, dt);
  if (!slots) {  // training: k and v in row order
    std::copy(k.begin(), k.end(), F(k_pool));
    std::copy(v.begin(), v.end(), F(v_pool));
    return;
  }
  scatter_rows(x, k.data(), slots, k_pool, N, Dk, false, dt);
  scatter_rows(x, v.data(), slots, v_pool, N, Dk, false, dt);
}
void rmsnorm_fwd(const Exec& x, const void* in, const void* w, void* y, float* rstd, int64_t N, int64_t D, double eps,
                 DType dt) {
  PROFILED(x, prof::shaped(__func__, N, D, D), prof::mem(2 * B(N * D, dt)));
  ON_CUDA(x, rmsnorm_fwd(x, in, w, y, rstd, N, D, eps, dt));
  need_f32(dt, "rmsnorm_fwd");
  ops::rmsnorm_fwd(F(in), F(w), F(y), rstd, N, D, eps);
}
void rmsnorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* rstd, void* din,
                 float* dw, int64_t N, int64_t D, bool accumulate, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, D, D), prof::mem(3 * B(N * D, dt)));
  ON_CUDA(x, rmsnorm_bwd(x, dy, in, w, rstd, din, dw, N, D, accumulate, dt));
  need_f32(dt, "rmsnorm_bwd");
  clear_unless(accumulate, din, N * D);
  ops::rmsnorm_bwd(F(dy), F(in), F(w), rstd, F(din), dw, N, D);
}
void layernorm_fwd(const Exec& x, const void* in, const void* w, const void* b, void* y, float* mean, float* rstd,
                   int64_t N, int64_t D, double eps, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, D, D), prof::mem(2 * B(N * D, dt)));
  ON_CUDA(x, layernorm_fwd(x, in, w, b, y, mean, rstd, N, D, eps, dt));
  need_f32(dt, "layernorm_fwd");
  ops::layernorm_fwd(F(in), F(w), F(b), F(y), mean, rstd, N, D, eps);
}
void layernorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* mean, const float* rstd,
                   void* din, float* dw, float* db, int64_t N, int64_t D, bool accumulate, DType dt) {
  PROFILED(x, prof::shaped(__func__, N, D, D), prof::mem(3 * B(N * D, dt)));
  ON_CUDA(x, layernorm_bwd(x, dy, in, w, mean, rstd, din, dw, db, N, D, accumulate, dt));
  need_f32(dt, "layernorm_bwd");
  clear_unless(accumulate, din, N * D);
  ops::layernorm_bwd(F(dy), F(in), F(w), mean, rstd, F(din), dw, db, N, D);
}

// ---- activations ----------------------------------------------------------------------------------------------------
void gelu_tanh_fwd(const Exec& x, const void* in, void* y, int64_t n, DType dt) {
  DEV_OP(x, prof::mem(2 * B(n, dt)), gelu_tanh_fwd(x, in, y, n, dt));
  need_f32(dt, "gelu_tanh_fwd");
  ops::gelu_tanh_fwd(F(in), F(y), n);
}
void gelu_tanh_bwd(const Exec& x, const void* dy, const void* in, void* din, int64_t n, bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(3 * B(n, dt)), gelu_tanh_bwd(x, dy, in, din, n, accumulate, dt));
  need_f32(dt, "gelu_tanh_bwd");
  clear_unless(accumulate, din, n);
  ops::gelu_tanh_bwd(F(dy), F(in), F(din), n);
}
void gelu_erf_fwd(const Exec& x, const void* in, void* y, int64_t n, DType dt) {
  DEV_OP(x, prof::mem(2 * B(n, dt)), gelu_erf_fwd(x, in, y, n, dt));
  need_f32(dt, "gelu_erf_fwd");
  ops::gelu_erf_fwd(F(in), F(y), n);
}
void gelu_erf_bwd(const Exec& x, const void* dy, const void* in, void* din, int64_t n, bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(3 * B(n, dt)), gelu_erf_bwd(x, dy, in, din, n, accumulate, dt));
  need_f32(dt, "gelu_erf_bwd");
  clear_unless(accumulate, din, n);
  ops::gelu_erf_bwd(F(dy), F(in), F(din), n);
}
void swiglu_fwd(const Exec& x, const void* gu, void* y, int64_t N, int64_t I, DType dt) {
  DEV_OP(x, prof::mem(3 * B(N * I, dt)), swiglu_fwd(x, gu, y, N, I, dt));
  need_f32(dt, "swiglu_fwd");
  ops::swiglu_fwd(F(gu), F(y), N, I);
}
void swiglu_bwd(const Exec& x, const void* dy, const void* gu, void* dgu, int64_t N, int64_t I, bool accumulate,
                DType dt) {
  DEV_OP(x, prof::mem(5 * B(N * I, dt)), swiglu_bwd(x, dy, gu, dgu, N, I, accumulate, dt));
  need_f32(dt, "swiglu_bwd");
  clear_unless(accumulate, dgu, N * 2 * I);
  ops::swiglu_bwd(F(dy), F(gu), F(dgu), N, I);
}

// ---- rotary -----------------------------------------------------------------------------------------------------------
void rope_fwd(const Exec& x, void* q, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd,
              DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * heads * hd, dt)), rope_fwd(x, q, cos, sin, N, heads, hd, dt));
  need_f32(dt, "rope_fwd");
  ops::rope_fwd(F(q), cos, sin, N, heads, hd);
}
void rope_bwd(const Exec& x, void* dq, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd,
              DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * heads * hd, dt)), rope_bwd(x, dq, cos, sin, N, heads, hd, dt));
  need_f32(dt, "rope_bwd");
  ops::rope_bwd(F(dq), cos, sin, N, heads, hd);
}
void rope_table(const Exec& x, const int32_t* pos, int64_t N, int64_t W, const int* axis, const float* freq,
                float* cos, float* sin) {
  Q3VL_CHECK(W > 0 && W <= 64, "rope_table: " + std::to_string(W) + " columns (at most 64)");
  DEV_OP(x, prof::mem(double(N) * W * 8), rope_table(x, pos, N, W, axis, freq, cos, sin));
  ops::rope_table(pos, N, W, axis, freq, cos, sin);
}

// ---- attention --------------------------------------------------------------------------------------------------------
void attention_fwd(const Exec& x, const void* q, const void* k, const void* v, void* out, float* lse,
                   const int32_t* cu, int64_t nseg, int64_t max_len, int64_t N, int64_t nh, int64_t nkv, int64_t hd,
                   bool causal, float scale, DType dt) {
  PROFILED(x, prof::shaped_attn(__func__, nseg, max_len, hd, causal),
           prof::flop(attention_flops(N, max_len, nh, hd, causal)));
  ON_CUDA(x, attention_fwd(x, q, k, v, out, lse, cu, nseg, max_len, N, nh, nkv, hd, causal, scale, dt));
  need_f32(dt, "attention_fwd");
  const auto cu64 = widen(cu, nseg + 1);
  ops::attention_fwd(F(q), F(k), F(v), F(out), lse, cu64.data(), nseg, nh, nkv, hd, causal, scale);
}
void attention_bwd(const Exec& x, const void* dout, const void* q, const void* k, const void* v, const void* out,
                   const float* lse, void* dq, void* dk, void* dv, const int32_t* cu, int64_t nseg, int64_t max_len,
                   int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool causal, float scale, bool accumulate,
                   DType dt) {
  PROFILED(x, prof::shaped_attn(__func__, nseg, max_len, hd, causal),
           prof::flop(2.5 * attention_flops(N, max_len, nh, hd, causal)));
  ON_CUDA(x, attention_bwd(x, dout, q, k, v, out, lse, dq, dk, dv, cu, nseg, max_len, N, nh, nkv, hd, causal, scale,
                           accumulate, dt));
  need_f32(dt, "attention_bwd");
  clear_unless(accumulate, dq, N * nh * hd);
  clear_unless(accumulate, dk, N * nkv * hd);
  clear_unless(accumulate, dv, N * nkv * hd);
  const auto cu64 = widen(cu, nseg + 1);
  ops::attention_bwd(F(dout), F(q), F(k), F(v), F(out), lse, F(dq), F(dk), F(dv), cu64.data(), nseg, nh, nkv, hd,
                     causal, scale);
}
// Plain loops in double: for each query row and head, the scores of positions [0, p] read through the block table,
// a max-subtracted softmax, the weighted sum of values. The reference the CUDA kernel is tested against.
void paged_attention_fwd(const Exec& x, const void* q, const void* k_pool, const void* v_pool, void* out,
                         const int32_t* cu, const int32_t* ctx, const int32_t* table, int64_t max_blocks,
                         int64_t block, int64_t nseg, int64_t max_q, int64_t max_ctx, int64_t keys, int64_t N,
                         int64_t nh, int64_t nkv, int64_t hd, float scale, DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * nh * hd, dt) + 2 * B((keys > 0 ? keys : nseg * max_ctx) * nkv * hd, dt)),
         paged_attention_fwd(x, q, k_pool, v_pool, out, cu, ctx, table, max_blocks, block, nseg, max_q, max_ctx, keys,
                             N, nh, nkv, hd, scale, dt));
  need_f32(dt, "paged_attention_fwd");
  Q3VL_CHECK(nkv > 0 && nh % nkv == 0 && block >= 1,
             "paged_attention_fwd: heads must be a multiple of kv heads and the block size at least 1");
  const float *Q = F(q), *K = F(k_pool), *V = F(v_pool);
  float* O = F(out);
  const int64_t G = nh / nkv;
  std::vector<double> s, o(hd);
  for (int64_t g = 0; g < nseg; ++g) {
    const int64_t r0 = cu[g], n = cu[g + 1] - r0, c = ctx[g];
    Q3VL_CHECK(n >= 0 && c >= n && (max_blocks * block >= c),
               "paged_attention_fwd: segment " + std::to_string(g) + " has " + std::to_string(n) +
                   " new tokens, a context of " + std::to_string(c) + " and room for " +
                   std::to_string(max_blocks * block));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = c - n + i;  // the row's position: keys [0, p]
      s.assign(p + 1, 0.0);
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t kh = h / G;
        const float* qr = Q + ((r0 + i) * nh + h) * hd;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= p; ++j) {
          const int64_t row = int64_t(table[g * max_blocks + j / block]) * block + j % block;
          const float* kr = K + (row * nkv + kh) * hd;
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += double(qr[e]) * kr[e];
          s[j] = d * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= p; ++j) sum += (s[j] = std::exp(s[j] - mx));
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j <= p; ++j) {
          const int64_t row = int64_t(table[g * max_blocks + j / block]) * block + j % block;
          const float* vr = V + (row * nkv + kh) * hd;
          for (int64_t e = 0; e < hd; ++e) o[e] += s[j] * vr[e];
        }
        float* orow = O + ((r0 + i) * nh + h) * hd;
        for (int64_t e = 0; e < hd; ++e) orow[e] = float(o[e] / sum);
      }
    }
  }
}

// ---- embeddings and row moves ---------------------------------------------------------------------------------------
void embedding_fwd(const Exec& x, const int32_t* ids, const void* table, void* out, int64_t N, int64_t D, int64_t V,
                   DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * D, dt)), embedding_fwd(x, ids, table, out, N, D, V, dt));
  need_f32(dt, "embedding_fwd");
  const auto id64 = widen(ids, N);
  ops::embedding_fwd(id64.data(), F(table), F(out), N, D, V);
}
void embedding_bwd(const Exec& x, const int32_t* ids, const void* dout, float* dtable, int64_t N, int64_t D,
                   DType dt) {
  DEV_OP(x, prof::mem(B(N * D, dt) + 8.0 * double(N * D)), embedding_bwd(x, ids, dout, dtable, N, D, dt));
  need_f32(dt, "embedding_bwd");
  const auto id64 = widen(ids, N);
  ops::embedding_bwd(id64.data(), F(dout), dtable, N, D);
}
void gather_rows(const Exec& x, const void* src, const int32_t* rows, int64_t div, void* dst, int64_t R, int64_t D,
                 DType dt) {
  DEV_OP(x, prof::mem(2 * B(R * D, dt)), gather_rows(x, src, rows, div, dst, R, D, dt));
  need_f32(dt, "gather_rows");
  copy_rows(F(src), rows, div, F(dst), R, D);
}
void copy_2d(const Exec& x, const void* src, int64_t lds, void* dst, int64_t ldd, int64_t rows, int64_t cols,
             DType dt) {
  DEV_OP(x, prof::mem(2 * B(rows * cols, dt)), copy_2d(x, src, lds, dst, ldd, rows, cols, dt));
  need_f32(dt, "copy_2d");
  ops_copy_2d(F(src), lds, F(dst), ldd, rows, cols);
}
void scatter_rows(const Exec& x, const void* src, const int32_t* rows, void* dst, int64_t R, int64_t D,
                  bool accumulate, DType dt) {
  DEV_OP(x, prof::mem((accumulate ? 3 : 2) * B(R * D, dt)), scatter_rows(x, src, rows, dst, R, D, accumulate, dt));
  need_f32(dt, "scatter_rows");
  for (int64_t i = 0; i < R; ++i) {
    if (rows[i] < 0) continue;
    float* d = F(dst) + int64_t(rows[i]) * D;
    const float* s = F(src) + i * D;
    for (int64_t j = 0; j < D; ++j) d[j] = accumulate ? d[j] + s[j] : s[j];
  }
}
void pos_embed_fwd(const Exec& x, const void* table, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                   int64_t merge, void* out, DType dt) {
  DEV_OP(x, prof::mem(2 * B(t * h * w * D, dt)), pos_embed_fwd(x, table, G, D, t, h, w, merge, out, dt));
  need_f32(dt, "pos_embed_fwd");
  ops::pos_embed_fwd(F(table), G, D, t, h, w, merge, F(out));
}
void pos_embed_bwd(const Exec& x, const void* dout, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                   int64_t merge, float* dtable, DType dt) {
  DEV_OP(x, prof::mem(B(t * h * w * D, dt) + 8.0 * double(t * h * w * D)), pos_embed_bwd(x, dout, G, D, t, h, w, merge, dtable, dt));
  need_f32(dt, "pos_embed_bwd");
  ops::pos_embed_bwd(F(dout), G, D, t, h, w, merge, dtable);
}

// ---- loss ------------------------------------------------------------------------------------------------------------
void argmax_rows(const Exec& x, const float* logits, int64_t S, int64_t V, int64_t v0, int64_t limit,
                 const int32_t* banned, int64_t nb, int32_t* idx, float* val) {
  DEV_OP(x, prof::mem(4.0 * double(S * V)), argmax_rows(x, logits, S, V, v0, limit, banned, nb, idx, val));
  for (int64_t i = 0; i < S; ++i) {
    const float* r = logits + i * V;
    int64_t best = -1;
    for (int64_t c = 0; c < V && v0 + c < limit; ++c)
      if ((best < 0 || r[c] > r[best]) && std::find(banned, banned + nb, int32_t(v0 + c)) == banned + nb) best = c;
    idx[i] = best < 0 ? -1 : int32_t(v0 + best);
    val[i] = best < 0 ? -FLT_MAX : r[best];
  }
}
void cross_entropy(const Exec& x, const void* logits, const int32_t* target, float* loss, void* dlogits,
                   double* loss_sum, int64_t N, int64_t V, float scale, bool accumulate, DType dt) {
  DEV_OP(x, prof::mem((dlogits ? 3 : 1) * B(N * V, dt)), cross_entropy(x, logits, target, loss, dlogits, loss_sum, N, V, scale, accumulate, dt));
  need_f32(dt, "cross_entropy");
  clear_unless(accumulate, dlogits, N * V);
  const auto t64 = widen(target, N);
  const double s = ops::cross_entropy(F(logits), t64.data(), loss, F(dlogits), N, V, scale);
  if (loss_sum) *loss_sum += s;
}

// ---- MoE ---------------------------------------------------------------------------------------------------------------
void router_fwd(const Exec& x, const void* logits, float* probs, int32_t* idx, float* w, int64_t N, int64_t E,
                int64_t k, DType dt) {
  DEV_OP(x, prof::mem(B(N * E, dt) + 4.0 * double(N * E)), router_fwd(x, logits, probs, idx, w, N, E, k, dt));
  need_f32(dt, "router_fwd");
  std::vector<int64_t> i64(N * k);
  ops::router_fwd(F(logits), probs, i64.data(), w, N, E, k);
  std::copy(i64.begin(), i64.end(), idx);
}
void router_bwd(const Exec& x, const float* dw, const float* probs, const int32_t* idx, void* dlogits, int64_t N,
                int64_t E, int64_t k, bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * E, dt) + 4.0 * double(N * E)), router_bwd(x, dw, probs, idx, dlogits, N, E, k, accumulate, dt));
  need_f32(dt, "router_bwd");
  clear_unless(accumulate, dlogits, N * E);
  const auto i64 = widen(idx, N * k);
  ops::router_bwd(dw, probs, i64.data(), F(dlogits), N, E, k);
}
void aux_loss_fwd(const Exec& x, const float* probs, const int32_t* idx, float* f, double* aux, int64_t N, int64_t E,
                  int64_t k) {
  DEV_OP(x, prof::mem(4.0 * double(N * E)), aux_loss_fwd(x, probs, idx, f, aux, N, E, k));
  const auto i64 = widen(idx, N * k);
  const double a = ops::aux_loss_fwd(probs, i64.data(), N, E, k, f);
  if (aux) *aux += a;
}
void aux_loss_bwd(const Exec& x, const float* probs, const float* f, float coef, void* dlogits, int64_t N, int64_t E,
                  bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(2 * B(N * E, dt) + 8.0 * double(N * E)), aux_loss_bwd(x, probs, f, coef, dlogits, N, E, accumulate, dt));
  need_f32(dt, "aux_loss_bwd");
  clear_unless(accumulate, dlogits, N * E);
  ops::aux_loss_bwd(probs, f, coef, F(dlogits), N, E);
}
void moe_plan(const Exec& x, const int32_t* idx, int64_t N, int64_t k, int64_t E, int32_t* start, int32_t* rows,
              int32_t* pos) {
  DEV_OP(x, prof::mem(12.0 * double(N * k)), moe_plan(x, idx, N, k, E, start, rows, pos));
  const int64_t R = N * k;
  std::fill(start, start + E + 1, 0);
  for (int64_t r = 0; r < R; ++r) start[idx[r] + 1]++;
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int32_t> next(start, start + E);
  for (int64_t r = 0; r < R; ++r) {  // r increases, so tokens increase inside each bucket
    const int32_t j = next[idx[r]]++;
    rows[j] = int32_t(r);
    pos[r] = j;
  }
}
void moe_route(const Exec& x, const void* in, const void* Wr, float* logits, float* probs, int32_t* idx, float* w,
               int32_t* start, int32_t* rows, int32_t* pos, int64_t N, int64_t H, int64_t E, int64_t k, DType dt) {
  DEV_OP(x, prof::mem(B(E * H, dt) + B(N * H, dt) + 4.0 * double((logits ? 2 : 1) * N * E + 4 * N * k + E + 1)),
         moe_route(x, in, Wr, logits, probs, idx, w, start, rows, pos, N, H, E, k, dt));
  std::vector<float> own(logits ? 0 : size_t(N * E));  // the logits when the caller does not keep them
  float* z = logits ? logits : own.data();
  gemm(x, false, true, N, E, H, 1.f, in, H, Wr, H, 0.f, z, E, dt, DType::F32);
  router_fwd(x, z, probs, idx, w, N, E, k, DType::F32);
  moe_plan(x, idx, N, k, E, start, rows, pos);
}
void grouped_linear_fwd(const Exec& x, const void* xg, const void* W, const int32_t* start, void* y, int64_t R,
                        int64_t E, int64_t n_in, int64_t n_out, DType dt, const RowsIn& rin) {
  DEV_OP(x, prof::flop(2.0 * double(R) * double(n_in) * double(n_out)), grouped_linear_fwd(x, xg, W, start, y, R, E, n_in, n_out, dt, rin));
  need_f32(dt, "grouped_linear_fwd");
  xg = rows_in(x, xg, rin, R, n_in, dt);
  for (int64_t e = 0; e < E; ++e)
    ops::linear_fwd(F(xg) + start[e] * n_in, F(W) + e * n_out * n_in, (const float*)nullptr, F(y) + start[e] * n_out,
                    start[e + 1] - start[e], n_in, n_out);
}
void grouped_linear_q8_fwd(const Exec& x, const void* xg, const void* q, const float* scale, const int32_t* start,
                           void* y, int64_t R, int64_t E, int64_t n_in, int64_t n_out, QFormat qf, DType dt,
                           const RowsIn& rin) {
  DEV_OP(x, prof::flop(2.0 * double(R) * double(n_in) * double(n_out)), grouped_linear_q8_fwd(x, xg, q, scale, start, y, R, E, n_in, n_out, qf, dt, rin));
  need_f32(dt, "grouped_linear_q8_fwd");
  xg = rows_in(x, xg, rin, R, n_in, dt);
  by_qformat(qf, q, [&](const auto* w) {
    for (int64_t e = 0; e < E; ++e)
      ops::linear_lowp_fwd(F(xg) + start[e] * n_in, w + e * n_out * n_in, scale + e * n_out, (const float*)nullptr,
                           F(y) + start[e] * n_out, start[e + 1] - start[e], n_in, n_out);
  });
}
void grouped_linear_bwd(const Exec& x, const void* dy, const void* xg, const void* W, const int32_t* start, void* dxg,
                        float* dW, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                        bool accumulate_dW, DType dt, const SumSq& dw_sq) {
  Q3VL_CHECK(!dw_sq.sum || (dW && !accumulate_dW), "dev::grouped_linear_bwd: dW's squares are taken of a written dW only");
  DEV_OP(x, prof::flop(2.0 * double(R) * double(n_in) * double(n_out) * ((dxg ? 1 : 0) + (dW ? 1 : 0))), grouped_linear_bwd(x, dy, xg, W, start, dxg, dW, R, E, n_in, n_out, accumulate, accumulate_dW, dt, dw_sq));
  need_f32(dt, "grouped_linear_bwd");
  clear_unless(accumulate, dxg, R * n_in);
  clear_unless(accumulate_dW, dW, E * n_out * n_in);
  for (int64_t e = 0; e < E; ++e)
    ops::linear_bwd(F(dy) + start[e] * n_out, F(xg) + start[e] * n_in, F(W) + e * n_out * n_in,
                    dxg ? F(dxg) + start[e] * n_in : nullptr, dW ? dW + e * n_out * n_in : nullptr, (float*)nullptr,
                    start[e + 1] - start[e], n_in, n_out);
  if (dw_sq.sum) add_squares(dW, E * n_out * n_in, dw_sq.sum, dw_sq.nonfinite);
}
void moe_combine_fwd(const Exec& x, const void* y, const int32_t* pos, const float* w, void* out, int64_t N, int64_t k,
                     int64_t H, DType dt, bool add) {
  DEV_OP(x, prof::mem(B(N * k * H, dt) + B(N * H, dt) * (add ? 2 : 1)),
         moe_combine_fwd(x, y, pos, w, out, N, k, H, dt, add));
  need_f32(dt, "moe_combine_fwd");
  std::vector<float> sum(size_t(std::max<int64_t>(H, 0)));
  for (int64_t t = 0; t < N; ++t) {
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t s = 0; s < k; ++s) {
      const float* yr = F(y) + int64_t(pos[t * k + s]) * H;
      const float ws = w[t * k + s];
      for (int64_t d = 0; d < H; ++d) sum[size_t(d)] += ws * yr[d];
    }
    float* o = F(out) + t * H;
    for (int64_t d = 0; d < H; ++d) o[d] = add ? o[d] + sum[size_t(d)] : sum[size_t(d)];
  }
}
void moe_combine_bwd(const Exec& x, const void* dout, const void* y, const int32_t* pos, const float* w, float* dw,
                     void* dy, int64_t N, int64_t k, int64_t H, bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(B(N * H, dt) + 3 * B(N * k * H, dt)), moe_combine_bwd(x, dout, y, pos, w, dw, dy, N, k, H, accumulate, dt));
  need_f32(dt, "moe_combine_bwd");
  clear_unless(accumulate, dy, N * k * H);
  for (int64_t r = 0; r < N * k; ++r) {
    const float* g = F(dout) + r / k * H;
    const float* yr = F(y) + int64_t(pos[r]) * H;
    float* dyr = F(dy) + int64_t(pos[r]) * H;
    float acc = 0;
    for (int64_t d = 0; d < H; ++d) {
      acc += g[d] * yr[d];
      dyr[d] += w[r] * g[d];
    }
    dw[r] = acc;
  }
}
void unpermute_add(const Exec& x, const void* src, const int32_t* pos, void* dst, int64_t N, int64_t k, int64_t H,
                   bool accumulate, DType dt) {
  DEV_OP(x, prof::mem(B(N * k * H, dt) + 2 * B(N * H, dt)), unpermute_add(x, src, pos, dst, N, k, H, accumulate, dt));
  need_f32(dt, "unpermute_add");
  clear_unless(accumulate, dst, N * H);
  for (int64_t r = 0; r < N * k; ++r) {
    const float* s = F(src) + int64_t(pos[r]) * H;
    float* d = F(dst) + r / k * H;
    for (int64_t j = 0; j < H; ++j) d[j] += s[j];
  }
}

// ---- optimizer and reductions ----------------------------------------------------------------------------------------
namespace {
// AdamW's element loop, four lanes at a time (the offloaded optimizer runs it on the host's cores): SSE's sqrt and
// division are IEEE-rounded like the scalar ones and every lane does the scalar loop's operations in its order, so
// the bits are the scalar loop's (the compiler keeps this loop scalar: sqrt's errno).
void adamw_loop(float* p, const float* g, float* m, float* v, int64_t n, float b1, float b2, float gs, float step,
                float sqrt_bc2, float e, float decay) {
  const float c1 = 1.f - b1, c2 = 1.f - b2;
  int64_t i = 0;
#ifdef __SSE2__
  const __m128 B1 = _mm_set1_ps(b1), B2 = _mm_set1_ps(b2), C1 = _mm_set1_ps(c1), C2 = _mm_set1_ps(c2),
               GS = _mm_set1_ps(gs), ST = _mm_set1_ps(step), SB = _mm_set1_ps(sqrt_bc2), E = _mm_set1_ps(e),
               D = _mm_set1_ps(decay);
  for (; i + 4 <= n; i += 4) {
    const __m128 gi = _mm_mul_ps(_mm_loadu_ps(g + i), GS);
    const __m128 mi = _mm_add_ps(_mm_mul_ps(B1, _mm_loadu_ps(m + i)), _mm_mul_ps(C1, gi));
    const __m128 vi = _mm_add_ps(_mm_mul_ps(B2, _mm_loadu_ps(v + i)), _mm_mul_ps(_mm_mul_ps(C2, gi), gi));
    _mm_storeu_ps(m + i, mi), _mm_storeu_ps(v + i, vi);
    const __m128 den = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), SB), E);
    _mm_storeu_ps(p + i, _mm_sub_ps(_mm_mul_ps(_mm_loadu_ps(p + i), D), _mm_div_ps(_mm_mul_ps(ST, mi), den)));
  }
#endif
  for (; i < n; ++i) {
    const float gi = g[i] * gs;
    const float mi = b1 * m[i] + c1 * gi, vi = b2 * v[i] + c2 * gi * gi;
    m[i] = mi, v[i] = vi;
    p[i] = p[i] * decay - step * mi / (std::sqrt(vi) / sqrt_bc2 + e);
  }
}
}  // namespace

void adamw(const Exec& x, float* p, const float* g, float* m, float* v, int64_t n, double beta1, double beta2,
           double eps, double lr, double weight_decay, double gscale, int64_t t, void* copy, DType copy_dt,
           const int32_t* skip) {
  Q3VL_CHECK(!copy || copy_dt == DType::F32 || copy_dt == DType::BF16 || copy_dt == DType::F16,
             std::string("dev::adamw: the parameter copy is F32, BF16 or F16, not ") + dtype_name(copy_dt));
  DEV_OP(x, prof::mem((28.0 + (copy ? double(dtype_size(copy_dt)) : 0.0)) * double(n)),
         adamw(x, p, g, m, v, n, beta1, beta2, eps, lr, weight_decay, gscale, t, copy, copy_dt, skip));
  if (skip && *skip) return;
  // PyTorch's semantics: decoupled weight decay p *= 1 - lr*wd before the Adam step; t counts updates from 1.
  const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
  const float b1 = float(beta1), b2 = float(beta2), gs = float(gscale);
  const float step = float(lr / bc1), sqrt_bc2 = float(std::sqrt(bc2)), e = float(eps);
  const float decay = float(1.0 - lr * weight_decay);
  adamw_loop(p, g, m, v, n, b1, b2, gs, step, sqrt_bc2, e, decay);
  if (copy) narrow(p, n, copy, copy_dt);
}
void sum_squares(const Exec& x, const void* a, int64_t n, DType dt, double* acc, int32_t* nonfinite) {
  DEV_OP(x, prof::mem(B(n, dt)), sum_squares(x, a, n, dt, acc, nonfinite));
  need_f32(dt, "sum_squares");
  add_squares(F(a), n, acc, nonfinite);
}
void sum_slots(const Exec& x, const double* sums, const int32_t* bad, const int32_t* ids, int64_t n, double* acc,
               int32_t* nonfinite) {
  DEV_OP(x, prof::mem(16.0 * double(n)), sum_slots(x, sums, bad, ids, n, acc, nonfinite));
  for (int64_t i = 0; i < n; ++i) *acc += sums[ids[i]], *nonfinite += bad[ids[i]];
}

}  // namespace q3vl::dev
