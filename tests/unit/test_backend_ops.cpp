// The op table (after llama.cpp's test-backend-ops): every device op x shapes x dtypes, run on the device under test
// and on the CPU reference from the same inputs (rounded to the case's dtype first, so only compute error is
// measured), compared by normalised error max|a-b| / max|ref| against a per-op bound. One line per case.
// On a machine without a GPU every dtype's table is skipped (failed under Q3VL_REQUIRE_GPU=1): the CPU against itself
// runs the same code on both sides and cannot fail. The paged attention and 8-bit tests below pin the CPU reference
// itself and run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../compare.hpp"
#include "../gpu.hpp"
#include "q3vl/core/dtype.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/tensor/ops.hpp"

using namespace q3vl;

namespace {

// What an argument holds on the device: activations in the case's dtype, or a fixed dtype. I8: bytes given as int8
// values (the weights of the 8-bit linears: int8 values, or fp8 codes as the int8 of the same byte), held as
// DType::U8 bytes (two's complement); inputs only. BF16, F16: 16-bit whatever the case's dtype (AdamW's copy).
enum class Kind { Act, F32, I32, F64, I8, BF16, F16 };

struct Arg {
  std::string name;
  Kind kind;
  std::vector<double> v;  // host values (indices as exact doubles)
  bool out = false;       // compared after the op
  bool exact = false;     // compared for equality (indices)
};

struct Case {
  std::string op, shape;
  DType dt = DType::F32;
  double tol = 0;  // normalised error bound
  std::vector<Arg> args;
  // Runs the op on `x` over the device pointers p[i] of args[i].
  std::function<void(const dev::Exec& x, const std::vector<void*>& p, DType dt)> run;
};

DType dtype_of(Kind k, DType act) {
  switch (k) {
    case Kind::Act: return act;
    case Kind::F32: return DType::F32;
    case Kind::I32: return DType::I32;
    case Kind::I8: return DType::U8;
    case Kind::BF16: return DType::BF16;
    case Kind::F16: return DType::F16;
    default: return DType::F64;
  }
}

// Host bytes of values in dtype t (rounding to nearest even for bf16/fp16), and back.
std::vector<char> encode(const std::vector<double>& v, DType t) {
  std::vector<char> b(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) switch (t) {
      case DType::F32: reinterpret_cast<float*>(b.data())[i] = float(v[i]); break;
      case DType::F64: reinterpret_cast<double*>(b.data())[i] = v[i]; break;
      case DType::I32: reinterpret_cast<int32_t*>(b.data())[i] = int32_t(v[i]); break;
      case DType::U8: reinterpret_cast<int8_t*>(b.data())[i] = int8_t(v[i]); break;  // Kind::I8
      case DType::BF16: reinterpret_cast<uint16_t*>(b.data())[i] = f32_to_bf16(float(v[i])); break;
      case DType::F16: reinterpret_cast<uint16_t*>(b.data())[i] = f32_to_f16(float(v[i])); break;
      default: ADD_FAILURE() << "dtype";
    }
  return b;
}
std::vector<double> decode(const std::vector<char>& b, DType t) {
  std::vector<double> v(b.size() / dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) switch (t) {
      case DType::F32: v[i] = reinterpret_cast<const float*>(b.data())[i]; break;
      case DType::F64: v[i] = reinterpret_cast<const double*>(b.data())[i]; break;
      case DType::I32: v[i] = reinterpret_cast<const int32_t*>(b.data())[i]; break;
      case DType::U8: v[i] = reinterpret_cast<const int8_t*>(b.data())[i]; break;  // Kind::I8
      case DType::BF16: v[i] = bf16_to_f32(reinterpret_cast<const uint16_t*>(b.data())[i]); break;
      case DType::F16: v[i] = f16_to_f32(reinterpret_cast<const uint16_t*>(b.data())[i]); break;
      default: ADD_FAILURE() << "dtype";
    }
  return v;
}

// Runs a case on an Exec with activations in `act`; returns every argument's values afterwards.
std::vector<std::vector<double>> execute(const Case& c, const dev::Exec& x, DType act) {
  std::vector<void*> p;
  for (const Arg& a : c.args) {
    const DType t = dtype_of(a.kind, act);
    auto bytes = encode(a.v, t);
    p.push_back(dev::alloc(x, bytes.size()));
    dev::to_device(x, p.back(), bytes.data(), bytes.size());
  }
  c.run(x, p, act);
  std::vector<std::vector<double>> res;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const DType t = dtype_of(c.args[i].kind, act);
    std::vector<char> bytes(c.args[i].v.size() * dtype_size(t));
    dev::to_host(x, bytes.data(), p[i], bytes.size());
    res.push_back(decode(bytes, t));
    dev::release(x, p[i]);
  }
  return res;
}

// ---- building cases ---------------------------------------------------------------------------------------------------
std::mt19937 rng(1234);
std::vector<double> randn(int64_t n, double s = 1.0) {
  std::normal_distribution<double> d(0.0, s);
  std::vector<double> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}
std::vector<double> randu(int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (auto& e : v) e = d(rng);
  return v;
}
std::vector<double> randi(int64_t n, int64_t hi) {  // [0, hi)
  std::uniform_int_distribution<int64_t> d(0, hi - 1);
  std::vector<double> v(n);
  for (auto& e : v) e = double(d(rng));
  return v;
}
Arg in(std::string n, Kind k, std::vector<double> v) { return Arg{std::move(n), k, std::move(v)}; }
Arg out(std::string n, Kind k, std::vector<double> v, bool exact = false) {
  return Arg{std::move(n), k, std::move(v), true, exact};
}
template <class T> T* P(const std::vector<void*>& p, int i) { return static_cast<T*>(p[i]); }

// Bounds: fp32 differs from the CPU only by summation order; bf16/fp16 by rounding of stored results.
struct Tol {
  double f32, f16, bf16;
  double at(DType t) const { return t == DType::F32 ? f32 : t == DType::F16 ? f16 : bf16; }
};
// kTable: ops whose outputs do not depend on dt (F32 from integer inputs).
constexpr Tol kTable{1e-6, 1e-6, 1e-6};
constexpr Tol kElem{1e-6, 2e-3, 1e-2}, kReduce{1e-5, 5e-3, 2e-2}, kGemm{1e-5, 5e-3, 2e-2}, kAttn{2e-5, 1e-2, 3e-2};
// linear_chain: three or four products in a row, each rounded to a 16-bit dtype where the reference keeps fp32.
constexpr Tol kChain{1e-5, 1e-2, 3e-2};

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// A backward op's input-gradient mode in a case's name: accumulated (as the other gradients) or written.
std::string mode(bool accumulate) { return accumulate ? "" : " din="; }
// grouped_linear_bwd's (accumulate, accumulate_dW): both added to, dxg written, both written (a fresh dW).
constexpr std::pair<bool, bool> kGroupedBwdModes[] = {{true, true}, {false, true}, {false, false}};
std::string dw_mode(bool accumulate_dW) { return accumulate_dW ? "" : " dW="; }

// Batched linears (dev::LinearBatch): the vision tower's fused qkv at its shape (three problems on one input, the row
// blocks of one [3D, D] weight, outputs [3][N][D]) and a small odd one of the same form (bias and output strides
// not 16-byte aligned in bf16/fp16: the bias rows and, where cuBLASLt declines, problem by problem); every operand
// its own stride, with gaps between the problems (the gaps of the written operands must come back untouched); a
// weight and bias shared by the problems (their gradients the problems' sum); a batch of one. The vision shape is in
// the op table at bf16 only (the training dtype; its fp32 reference takes seconds a case).
struct BatchedShape {
  int64_t N, I, O;
  dev::LinearBatch bt;
  std::string what;
};
std::vector<BatchedShape> batched_shapes(bool table, DType dt = DType::F32) {
  auto qkv = [](int64_t N, int64_t D) { return BatchedShape{N, D, D, {3, 0, D * D, D, N * D}, " qkv"}; };
  std::vector<BatchedShape> v{qkv(45, 37),
                              {45, 40, 37, {3, 0, 37 * 40, 37, 45 * 37}, " shared x"},
                              {33, 64, 48, {2, 33 * 64 + 8, 48 * 64 + 8, 48 + 8, 33 * 48 + 8}, " apart"},
                              {20, 30, 50, {3, 20 * 30, 0, 0, 20 * 50}, " shared W"},
                              {1, 16, 8, {1, 0, 0, 0, 0}, " one"}};
  if (table && dt == DType::BF16) v.insert(v.begin(), qkv(784, 1152));
  return v;
}
// Elements an operand of `extent` takes in a batch: the last problem's end.
int64_t span(int64_t count, int64_t stride, int64_t extent) { return (count - 1) * stride + extent; }

// Packed segments: cu_seqlens from lengths.
std::vector<double> cu_of(const std::vector<int64_t>& lens) {
  std::vector<double> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + double(l));
  return cu;
}

// Rotary tables for N tokens at head dim hd: cos and sin [N, hd / 2] of random angles.
struct Rotary {
  std::vector<double> cos, sin;
};
Rotary rotary(int64_t N, int64_t hd) {
  const auto ang = randu(N * hd / 2, -3.1, 3.1);
  Rotary r{std::vector<double>(ang.size()), std::vector<double>(ang.size())};
  for (size_t i = 0; i < ang.size(); ++i) r.cos[i] = std::cos(ang[i]), r.sin[i] = std::sin(ang[i]);
  return r;
}

// A paged KV layout for segments of (new rows, context): the segments' blocks are a shuffled subset of a pool that
// has `spare` blocks more, and the table's entries past a segment's blocks name spare blocks, so a kernel that reads
// rows no table entry in range references reads random values, not zeros. cap > 0: table rows of cap tokens and
// max_ctx = cap, as serving's decode steps (captured as CUDA graphs) pass them: the contexts only in ctx.
struct Paged {
  std::vector<double> cu{0}, ctx, table;
  int64_t N = 0, max_blocks = 0, pool_rows = 0, max_q = 0, max_ctx = 0;
};
Paged paged_layout(const std::vector<std::pair<int64_t, int64_t>>& segs, int64_t block, int64_t spare,
                   int64_t cap = 0) {
  Paged P;
  int64_t used = 0;
  for (auto [n, c] : segs) {
    const int64_t nb = (c + block - 1) / block;
    used += nb;
    P.max_blocks = std::max(P.max_blocks, nb + 2);
    P.N += n;
    P.cu.push_back(double(P.N));
    P.ctx.push_back(double(c));
    P.max_q = std::max(P.max_q, n);
    P.max_ctx = std::max(P.max_ctx, c);
  }
  if (cap > 0) P.max_blocks = std::max(P.max_blocks, (cap + block - 1) / block), P.max_ctx = P.max_blocks * block;
  std::vector<int64_t> ids(used + spare);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t next = 0;
  for (auto [n, c] : segs) {
    const int64_t nb = (c + block - 1) / block;
    for (int64_t j = 0; j < P.max_blocks; ++j) P.table.push_back(double(j < nb ? ids[next++] : ids[used + j % spare]));
  }
  P.pool_rows = (used + spare) * block;
  return P;
}

// Router inputs for the backward ops: probabilities and top-k from the CPU router on random logits.
void route(int64_t N, int64_t E, int64_t k, std::vector<double>& probs, std::vector<double>& idx) {
  auto z = randn(N * E);
  std::vector<float> zf(z.begin(), z.end()), pf(N * E), wf(N * k);
  std::vector<int64_t> ix(N * k);
  ops::router_fwd(zf.data(), pf.data(), ix.data(), wf.data(), N, E, k);
  probs.assign(pf.begin(), pf.end());
  idx.assign(ix.begin(), ix.end());
}
// moe_route inputs whose logits are exact in fp32 whatever the summation order, from bf16/fp16 inputs too: x and Wr
// are integers in [-4, 4] over 8 (exact in every dtype), so each product is an integer over 64 and each partial sum of
// H <= 2048 of them an integer below 2^15 over 64. The top-k picks then cannot differ by rounding (distinct logits
// differ by 1/64 or more, their probabilities by 1.5% or more), and ties are built in: k + 1 experts share one weight
// row, which row 0 of x matches on its first 64 columns (the k + 1 lead row 0, tied: the k lowest indices win), and
// three others share another (ties anywhere in the other rows' order).
void route_inputs(int64_t N, int64_t H, int64_t E, int64_t k, std::vector<double>& x, std::vector<double>& W) {
  auto q = [](int64_t n) {
    auto v = randi(n, 9);
    for (double& e : v) e = (e - 4) / 8;
    return v;
  };
  x = q(N * H), W = q(E * H);
  auto tie = [&](int64_t dst, int64_t src) { std::copy_n(W.begin() + src * H, H, W.begin() + dst * H); };
  auto lead = [&](int64_t j) { return (3 + 7 * j) % E; };  // distinct for j <= k < E (7 is prime to E = 2^m)
  for (int64_t j = 1; j <= k; ++j) tie(lead(j), lead(0));
  for (int64_t j = 1; j < 3; ++j) tie(lead(j) + 1, lead(0) + 1);  // lead(j) + 1 is no lead(i) at these shapes
  for (int64_t c = 0; c < H; ++c) x[c] = c < 64 ? W[lead(0) * H + c] : 0.0;
}
// Expert buckets on the host (dev::moe_plan's contract) for grouped GEMM and combine inputs.
void plan(const std::vector<double>& idx, int64_t E, std::vector<double>& start, std::vector<double>& pos) {
  std::vector<int32_t> i32(idx.begin(), idx.end()), st(E + 1), rows(idx.size()), ps(idx.size());
  dev::moe_plan(dev::Exec{}, i32.data(), int64_t(idx.size()), 1, E, st.data(), rows.data(), ps.data());
  start.assign(st.begin(), st.end());
  pos.assign(ps.begin(), ps.end());
}

// start[E+1] of rows whose experts are `expert` (sorted by expert, as moe_plan buckets them).
std::vector<double> starts_of(const std::vector<double>& expert, int64_t E) {
  std::vector<double> st(size_t(E) + 1, 0);
  for (double e : expert) st[size_t(e) + 1]++;
  for (int64_t e = 0; e < E; ++e) st[size_t(e) + 1] += st[size_t(e)];
  return st;
}
// Random 8-bit weights of format qf, rows [rows, I] (experts: E * O rows) with their row scales, from
// ops::quantize_rows of random weights.
void q8_weights(QFormat qf, int64_t rows, int64_t I, std::vector<uint8_t>& q, std::vector<float>& sc) {
  auto w = randn(rows * I, 0.05);
  const std::vector<float> wf(w.begin(), w.end());
  q.resize(size_t(rows * I)), sc.resize(size_t(rows));
  ops::quantize_rows(qf, wf.data(), rows, I, q.data(), sc.data());
}
// The bytes as Kind::I8 values (each byte's int8).
std::vector<double> i8_values(const std::vector<uint8_t>& q) {
  std::vector<double> v(q.size());
  for (size_t i = 0; i < q.size(); ++i) v[i] = double(int8_t(q[i]));
  return v;
}
// The weight q[i] * sc[row] of 8-bit rows of I columns, as the products see it.
float q8_weight(QFormat qf, const std::vector<uint8_t>& q, const std::vector<float>& sc, size_t i, int64_t I) {
  const float w = qf == QFormat::Int8 ? float(int8_t(q[i])) : fp8_e4m3_to_f32(q[i]);
  return w * sc[i / size_t(I)];
}

// A chain link's [rows, cols] weights and their scales as op-table inputs: 8-bit bytes of format qf as Kind::I8
// values, or (qf None) in the activations' type with one unused scale.
std::pair<Arg, Arg> chain_weights(QFormat qf, const std::string& name, int64_t rows, int64_t cols) {
  if (qf == QFormat::None)
    return {in("w_" + name, Kind::Act, randn(rows * cols, 0.05)), in("s_" + name, Kind::F32, {1.0})};
  std::vector<uint8_t> q;
  std::vector<float> sc;
  q8_weights(qf, rows, cols, q, sc);
  return {in("q_" + name, Kind::I8, i8_values(q)),
          in("s_" + name, Kind::F32, std::vector<double>(sc.begin(), sc.end()))};
}

std::vector<Case> all_cases(DType dt) {
  std::vector<Case> cs;
  auto add = [&](std::string op, std::string shape, Tol tol, std::vector<Arg> args,
                 std::function<void(const dev::Exec&, const std::vector<void*>&, DType)> run) {
    cs.push_back(Case{std::move(op), std::move(shape), dt, tol.at(dt), std::move(args), std::move(run)});
  };
  using K = Kind;

  // elementwise; 1001 and 1023 leave tails of 1 and 7 elements past the 16-byte vectors
  for (int64_t n : {1, 1001, 1023, 65537}) {
    add("axpy", dims({n}), kElem, {in("a", K::Act, randn(n)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::axpy(x, -0.75f, p[0], p[1], n, t); });
    add("scale", dims({n}), kElem, {out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::scale(x, p[0], n, 1.5f, t); });
    add("fill", dims({n}), kElem, {out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::fill(x, p[0], t, n, 0.375f); });
    add("convert", dims({n}), kElem, {in("a", K::F32, randn(n)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::convert(x, p[1], t, p[0], DType::F32, n); });
    // LoRA's dropout: the CUDA mask must be the CPU's bit for bit (a dropped element off by one is a 100% error).
    add("dropout_fwd", dims({n}), kElem, {in("x", K::Act, randn(n)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::dropout_fwd(x, p[0], p[1], n, 0.3, 0x5eedull + uint64_t(n), 7 * n, t); });
    add("dropout_bwd", dims({n}), kElem, {in("dy", K::Act, randn(n)), out("dx", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::dropout_bwd(x, p[0], p[1], n, 0.1, 0xd0ull + uint64_t(n), 0, t); });
    add("gelu_tanh_fwd", dims({n}), kElem, {in("x", K::Act, randn(n, 2)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::gelu_tanh_fwd(x, p[0], p[1], n, t); });
    for (bool acc : {true, false})
      add("gelu_tanh_bwd", dims({n}) + mode(acc), kElem,
          {in("dy", K::Act, randn(n)), in("x", K::Act, randn(n, 2)), out("dx", K::Act, randn(n))},
          [n, acc](auto& x, auto& p, DType t) { dev::gelu_tanh_bwd(x, p[0], p[1], p[2], n, acc, t); });
    add("gelu_erf_fwd", dims({n}), kElem, {in("x", K::Act, randn(n, 2)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) { dev::gelu_erf_fwd(x, p[0], p[1], n, t); });
    for (bool acc : {true, false})
      add("gelu_erf_bwd", dims({n}) + mode(acc), kElem,
          {in("dy", K::Act, randn(n)), in("x", K::Act, randn(n, 2)), out("dx", K::Act, randn(n))},
          [n, acc](auto& x, auto& p, DType t) { dev::gelu_erf_bwd(x, p[0], p[1], p[2], n, acc, t); });
  }
  {  // pointers one element past 16-byte alignment: the maps' scalar path
    const int64_t n = 1001;
    add("axpy", dims({n}) + " +1", kElem, {in("a", K::Act, randn(n)), out("y", K::Act, randn(n))},
        [n](auto& x, auto& p, DType t) {
          auto at1 = [t](void* q) { return static_cast<char*>(q) + dtype_size(t); };
          dev::axpy(x, -0.75f, at1(p[0]), at1(p[1]), n - 1, t);
        });
  }
  // I a multiple of 8 (16-byte vectors in bf16/fp16), of 4 or 2 only, or odd (one column a thread); one row or many
  for (auto [N, I] : {std::pair<int64_t, int64_t>{17, 300}, {64, 1024}, {1, 1024}, {9, 6}, {1, 37}, {33, 37}}) {
    add("swiglu_fwd", dims({N, I}), kElem, {in("gu", K::Act, randn(N * 2 * I, 2)), out("y", K::Act, randn(N * I))},
        [N, I](auto& x, auto& p, DType t) { dev::swiglu_fwd(x, p[0], p[1], N, I, t); });
    for (bool acc : {true, false})
      add("swiglu_bwd", dims({N, I}) + mode(acc), kElem,
          {in("dy", K::Act, randn(N * I)), in("gu", K::Act, randn(N * 2 * I, 2)),
           out("dgu", K::Act, randn(N * 2 * I))},
          [N, I, acc](auto& x, auto& p, DType t) { dev::swiglu_bwd(x, p[0], p[1], p[2], N, I, acc, t); });
  }

  // GEMM and linear
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (DType ct : {DType::F32, dt}) {
        const int64_t M = 37, N = 53, K = 70;
        const int64_t lda = ta ? M : K, ldb = tb ? K : N;
        const bool c32 = ct == DType::F32;  // else C in the activation dtype (fp32 on the reference side)
        add("gemm", dims({M, N, K}) + (ta ? " tA" : "") + (tb ? " tB" : "") + " C=" + dtype_name(ct), kGemm,
            {in("A", K::Act, randn(M * K)), in("B", K::Act, randn(K * N)), out("C", c32 ? K::F32 : K::Act, randn(M * N))},
            [=](auto& x, auto& p, DType t) {
              dev::gemm(x, ta, tb, M, N, K, 0.5f, p[0], lda, p[1], ldb, 1.f, p[2], N, t, c32 ? DType::F32 : t);
            });
        if (ct == dt) break;  // fp32 cases: one C dtype
      }
  // {1 and 8, 1152, 1000}: the TMA-fed GEMV's shapes (9 panels of 64 bf16 columns, a tile of 16 rows cut short),
  // which linear_fwd takes for up to 8 rows whose x fits 48 KiB as halves under Q3VL_GEMV_TMA=1 (by default cuBLASLt
  // takes them: gemv_tma.cuh's tma_wanted).
  for (auto [N, I, O] : {std::tuple<int64_t, int64_t, int64_t>{45, 96, 200}, {1, 64, 64}, {300, 1152, 512},
                         {1, 1152, 1000}, {8, 1152, 1000}}) {
    for (bool bias : {false, true}) {
      add("linear_fwd", dims({N, I, O}) + (bias ? " bias" : ""), kGemm,
          {in("x", K::Act, randn(N * I)), in("W", K::Act, randn(O * I, 0.05)), in("b", K::Act, randn(O)),
           out("y", K::Act, randn(N * O))},
          [=](auto& x, auto& p, DType t) { dev::linear_fwd(x, p[0], p[1], bias ? p[2] : nullptr, p[3], N, I, O, t); });
    }
    // The weight gradients added (later contributions), or written (the step's first: dW and db over random values).
    for (auto [acc, acc_w] : {std::pair{true, true}, {false, true}, {false, false}})
      add("linear_bwd", dims({N, I, O}) + mode(acc) + (acc_w ? "" : " dW="), kGemm,
          {in("dy", K::Act, randn(N * O)), in("x", K::Act, randn(N * I)), in("W", K::Act, randn(O * I, 0.05)),
           out("dx", K::Act, randn(N * I)), out("dW", K::F32, randn(O * I)), out("db", K::F32, randn(O))},
          [=](auto& x, auto& p, DType t) {
            dev::linear_bwd(x, p[0], p[1], p[2], p[3], P<float>(p, 4), P<float>(p, 5), N, I, O, acc, acc_w, t);
          });
  }
  for (const BatchedShape& sh : batched_shapes(true, dt)) {
    const int64_t N = sh.N, I = sh.I, O = sh.O, n = sh.bt.count;
    const dev::LinearBatch bt = sh.bt;
    const std::string d = dims({N, I, O}) + " x" + std::to_string(n) + sh.what;
    const int64_t sx = span(n, bt.in, N * I), sw = span(n, bt.W, O * I), sb = span(n, bt.b, O);
    const int64_t sy = span(n, bt.y, N * O);
    for (bool bias : {false, true})
      add("linear_fwd_batched", d + (bias ? " bias" : ""), kGemm,
          {in("x", K::Act, randn(sx)), in("W", K::Act, randn(sw, 0.05)), in("b", K::Act, randn(sb)),
           out("y", K::Act, randn(sy))},
          [=](auto& x, auto& p, DType t) {
            dev::linear_fwd_batched(x, p[0], p[1], bias ? p[2] : nullptr, p[3], N, I, O, bt, t);
          });
    for (auto [acc, acc_w] : {std::pair{true, true}, {false, true}, {false, false}})
      add("linear_bwd_batched", d + mode(acc) + (acc_w ? "" : " dW="), kGemm,
          {in("dy", K::Act, randn(sy)), in("x", K::Act, randn(sx)), in("W", K::Act, randn(sw, 0.05)),
           out("dx", K::Act, randn(sx)), out("dW", K::F32, randn(sw)), out("db", K::F32, randn(sb))},
          [=](auto& x, auto& p, DType t) {
            dev::linear_bwd_batched(x, p[0], p[1], p[2], p[3], P<float>(p, 4), P<float>(p, 5), N, I, O, bt, acc,
                                    acc_w, t);
          });
  }
  // Weight-only 8-bit linear, int8 and fp8 (E4M3): q and scale from ops::quantize_rows of random weights. N <= 16
  // is the CUDA GEMV (n_in 102: no 16-byte rows, the scalar loads; 4096 at N 16: x staged in two chunks; n_out
  // 20001: more row tiles than the GPU holds blocks, so a warp streams several), larger N the dequantize + GEMM path;
  // "ws256K" gives that path a small workspace so that n_out splits into several tiles.
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8})
    for (int64_t N : {1, 2, 3, 4, 7, 16, 17, 64, 300})
      for (auto [I, O, small_ws] : {std::tuple<int64_t, int64_t, bool>{64, 48, false}, {256, 1000, false},
                                    {4096, 33, false}, {102, 37, false}, {256, 1000, true}, {256, 20001, false}}) {
        if ((small_ws && N <= 16) || (O == 20001 && N > 16)) continue;
        std::vector<uint8_t> q8;
        std::vector<float> sc;
        q8_weights(qf, O, I, q8, sc);
        const std::vector<double> qv = i8_values(q8), sv(sc.begin(), sc.end());
        for (bool bias : {false, true})
          add("linear_q8_fwd",
              std::string(qformat_name(qf)) + " " + dims({N, I, O}) + (bias ? " bias" : "") +
                  (small_ws ? " ws256K" : ""),
              kGemm,
              {in("x", K::Act, randn(N * I)), in("q", K::I8, qv), in("scale", K::F32, sv), in("b", K::Act, randn(O)),
               out("y", K::Act, randn(N * O))},
              [=](auto& x, auto& p, DType t) {
                dev::Exec xs = x;
                if (small_ws) xs.ws_bytes = std::min<size_t>(x.ws_bytes, size_t(256) << 10);
                dev::linear_q8_fwd(xs, p[0], p[1], P<float>(p, 2), bias ? p[3] : nullptr, p[4], N, I, O, qf, t);
              });
      }

  // The tensor-core GEMV's edges (16-bit activations; fp32 runs the CUDA-core one): n 1, 3, 8, 9 (two n-tiles), 16;
  // n_in 4136 (a 40-column tail past the 64-column warp steps), 72, 1001 (odd: scalar loads, unaligned x rows);
  // n_out 40 and 37 (row tiles of 16 cut short), 4104 (past 4096: the 4-warp knobs, gemv.cuh's launch_knobs).
  // {1152, 1000} at 2 <= n <= 8 is the TMA-fed GEMV's (gemv_tma.cuh: 9 panels of 128 bytes, two
  // stages, the second mostly past the row; the last row tile cut short), as are {256, 1000} and {256, 20001} above
  // (more tiles than blocks: a block's ring runs on across its tiles); at n = 1 under Q3VL_GEMV_TMA=1 (by default
  // only matrices of 64 MiB or more: tma_wanted).
  // "wide": x rows with entries near +-1e5 beside ones near 1e-3 (bf16 x enters the f16 mmas scaled by a power of two
  // per row: no overflow, no clipping), and the last row all tiny; fp16 x takes 1e3 (3e4 overflowed y itself, fp16
  // too).
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8})
    for (int64_t N : {1, 3, 8, 9, 16})
      for (auto [I, O] : {std::pair<int64_t, int64_t>{4136, 40}, {72, 37}, {1001, 37}, {72, 4104}, {1152, 1000}})
        for (bool wide : {false, true}) {
          std::vector<uint8_t> q8;
          std::vector<float> sc;
          q8_weights(qf, O, I, q8, sc);
          std::vector<double> xv = randn(N * I);
          if (wide) {
            const double big = dt == DType::F16 ? 1e3 : 1e5;  // fp16: y must fit too
            for (int64_t i = 0; i < N * I; ++i)
              if (i / I == N - 1 && N > 1) xv[size_t(i)] *= 1e-3;
              else if (i % 7 == 3) xv[size_t(i)] = i % 2 ? big : -big;
              else if (i % 5 == 1) xv[size_t(i)] *= 1e-3;
          }
          add("linear_q8_fwd",
              std::string(qformat_name(qf)) + " " + dims({N, I, O}) + " tc" + (wide ? " wide" : ""), kGemm,
              {in("x", K::Act, xv), in("q", K::I8, i8_values(q8)),
               in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())), in("b", K::Act, randn(O)),
               out("y", K::Act, randn(N * O))},
              [=](auto& x, auto& p, DType t) {
                dev::linear_q8_fwd(x, p[0], p[1], P<float>(p, 2), p[3], p[4], N, I, O, qf, t);
              });
        }

  // The decode folds of the residual stream (model/dev_layers.hpp's dev_decoder_infer): x read through its RMSNorm
  // (dev::RowsIn's norm) and the product added to y (add), together and apart. On CUDA, N <= 16 stages x whole and
  // normalizes it in the GEMV (the ring's and, at 1152 x 1000 and 2 <= N <= 8, the TMA-fed kernel's staging), except
  // 4096 columns at N 16 (more than one chunk: the norm written to scratch first); 1001 columns: scalar loads of x
  // and the norm's weights; N 40: the dequantize + GEMM path (the norm in scratch, the add in the GEMM's epilogue).
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8})
    for (int64_t N : {1, 3, 8, 16, 40})
      for (auto [I, O] : {std::pair<int64_t, int64_t>{1152, 1000}, {4096, 33}, {1001, 37}})
        for (auto [norm, plus] : {std::pair<bool, bool>{true, false}, {false, true}, {true, true}}) {
          std::vector<uint8_t> q8;
          std::vector<float> sc;
          q8_weights(qf, O, I, q8, sc);
          std::vector<double> g = randn(I, 0.3);
          for (double& v : g) v += 1.0;
          add("linear_q8_fwd",
              std::string(qformat_name(qf)) + " " + dims({N, I, O}) + (norm ? " norm" : "") + (plus ? " add" : ""),
              kGemm,
              {in("x", K::Act, randn(N * I, 3.0)), in("q", K::I8, i8_values(q8)),
               in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())), in("norm", K::Act, g),
               in("scratch", K::Act, std::vector<double>(size_t(N * I), 0.0)), out("y", K::Act, randn(N * O))},
              [=](auto& x, auto& p, DType t) {
                const dev::RowsIn rin = norm ? dev::RowsIn{nullptr, 1, false, p[4], p[3], 1e-6f} : dev::RowsIn{};
                dev::linear_q8_fwd(x, p[0], p[1], P<float>(p, 2), nullptr, p[5], N, I, O, qf, t, rin, plus);
              });
        }

  // A decode layer's chain of linears (dev::linear_chain, dev_decoder_infer's): o_proj adds to x, gate_up reads x
  // through its norm, down_proj reads the SwiGLU of gate_up's output and adds to x; with qkv first (x through its
  // norm), each link reading what the ones before wrote. Weights int8, fp8 or in the activations' type ("w16"). On
  // CUDA, N <= 8 is one persistent kernel (gemv_chain.cuh), with more tiles than blocks at gate_up (10240 rows: 640
  // tiles of 16; a block's ring runs across links and tiles); the links one by one where one does not fit it: N 16,
  // N 8 at I 5120 (down_proj's x over 48 KiB), and 1001 columns (no 128-byte panels); 16-bit weights one by one are
  // linear_fwd's RowsIn and add (cuBLASLt after the rows are written out). gate_up is a SwiGLU pair (ChainLink's
  // swiglu_pair: in the kernel its tiles write the SwiGLU into down_proj's scratch, which down_proj reads as is), as
  // dev_decoder_infer's; "staged" cases (N <= 2) are not (down_proj's staging computes the SwiGLU).
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8, QFormat::None})
    for (int64_t N : {1, 2, 3, 8, 16})
      for (auto [H, I, with_qkv] : {std::tuple<int64_t, int64_t, bool>{256, 5120, false}, {384, 640, true},
                                    {1001, 384, false}})
        for (const bool pair : {true, false}) {
          if ((H == 1001 && N != 1) || (!pair && N > 2)) continue;
          const int64_t Dq = H, Qkv = 2 * H;  // q as wide as x, k and v half of it each
          const bool w16 = qf == QFormat::None;
          const auto weights = [&](const std::string& name, int64_t rows, int64_t cols) {
            return chain_weights(qf, name, rows, cols);
          };
          const auto [wq, sq] = weights("qkv", Qkv, H);
          const auto [wo, so] = weights("o", H, Dq);
          const auto [wg, sg] = weights("gu", 2 * I, H);
          const auto [wd, sd] = weights("down", H, I);
          std::vector<double> g1 = randn(H, 0.3), g2 = randn(H, 0.3);
          for (double& v : g1) v += 1.0;
          for (double& v : g2) v += 1.0;
          add("linear_chain",
              std::string(w16 ? "w16" : qformat_name(qf)) + " " + dims({N, H, I}) +
                  (with_qkv ? " qkv o gu down" : " o gu down") + (pair ? "" : " staged"),
              kChain,
              {wq, sq, wo, so, wg, sg, wd, sd, in("norm1", K::Act, g1), in("norm2", K::Act, g2),
               in("scratch", K::Act, std::vector<double>(size_t(N * std::max(H, I)), 0.0)),
               out("x", K::Act, randn(N * H, 3.0)), out("qkv", K::Act, randn(N * Qkv)),
               in("att", K::Act, randn(N * Dq)),
               pair ? in("gu", K::Act, randn(N * 2 * I)) : out("gu", K::Act, randn(N * 2 * I))},  // paired: unwritten
              [=](auto& x, auto& p, DType t) {
                const dev::RowsIn n1{nullptr, 1, false, p[10], p[8], 1e-6f}, n2{nullptr, 1, false, p[10], p[9], 1e-6f};
                const auto sc = [&](int i) { return w16 ? nullptr : P<float>(p, i); };
                std::vector<dev::ChainLink> l;
                if (with_qkv) l.push_back({p[11], p[0], sc(1), p[12], H, Qkv, n1, false});
                // o_proj reads att (attention's output, not part of the chain)
                l.push_back({p[13], p[2], sc(3), p[11], Dq, H, {}, true});
                l.push_back({p[11], p[4], sc(5), p[14], H, 2 * I, n2, false});
                l.back().swiglu_pair = pair;
                l.push_back({p[14], p[6], sc(7), p[11], I, H, {nullptr, 1, true, p[10]}, true});
                dev::linear_chain(x, l.data(), int(l.size()), N, qf, t);
              });
        }

  // A decode step's attention as a chain link (dev::ChainAttn): the fused projection rows into the pools (new keys
  // normalized and rotated, values as they are, at their slots) and the paged attention of the normalized, rotated
  // queries into att. Alone, after the qkv product that writes its rows (x through its norm) and before o_proj that
  // reads att and adds to x (the link between two products of one kernel: att read at L2). On CUDA (bf16, fp16) one
  // persistent kernel for N <= 8 at head dims 64 and 128 (chain_attn.cuh): decode rows of contexts 1 to 2000 with the
  // table's capacity as max_ctx (serving's graphs: the key splits sized on the device, the split holding the new key
  // writing it), segments of several new rows (causal within them), one kv head; hd 72 and more query heads a kv head
  // than a unit holds take the links one by one.
  {
    using Segs = std::vector<std::pair<int64_t, int64_t>>;
    struct AttnCase {
      std::string name;
      Segs segs;
      int64_t block, nh, nkv, hd, cap;
    };
    const std::vector<AttnCase> acs{
        {"decode ctx{300,1,17,2000} max_ctx 8192", {{1, 300}, {1, 1}, {1, 17}, {1, 2000}}, 16, 8, 2, 128, 8192},
        {"decode ctx{700,33}", {{1, 700}, {1, 33}}, 32, 4, 4, 64, 0},
        {"n/ctx{3/40,1/9,4/4}", {{3, 40}, {1, 9}, {4, 4}}, 16, 8, 1, 64, 0},
        {"n/ctx{2/130,1/64}", {{2, 130}, {1, 64}}, 16, 4, 2, 72, 0},
        {"decode ctx{90} G 64", {{1, 90}}, 16, 64, 1, 64, 0}};
    for (const AttnCase& ac : acs)
      for (int form = 0; form < 2; ++form)
        for (const QFormat qf : {QFormat::Fp8, QFormat::None}) {
          if (form == 0 && qf != QFormat::None) continue;  // attention alone: no weights
          const Paged L = paged_layout(ac.segs, ac.block, 5, ac.cap);
          const int64_t N = L.N, nh = ac.nh, nkv = ac.nkv, hd = ac.hd, Dq = nh * hd, Qkv = (nh + 2 * nkv) * hd;
          const int64_t H = 256, mb = L.max_blocks, block = ac.block;
          std::vector<double> slots;  // each new row's pool row, from the table
          for (size_t sg = 0; sg < ac.segs.size(); ++sg)
            for (int64_t i = 0; i < ac.segs[sg].first; ++i) {
              const int64_t pos = ac.segs[sg].second - ac.segs[sg].first + i;
              slots.push_back(L.table[sg * size_t(mb) + size_t(pos / block)] * double(block) + double(pos % block));
            }
          const Rotary r = rotary(N, hd);
          const auto [wqkv, sqkv] = chain_weights(qf, "qkv", Qkv, H);
          const auto [wo, so] = chain_weights(qf, "o", H, Dq);
          std::vector<double> g1 = randn(H, 0.3);
          for (double& v : g1) v += 1.0;
          const int64_t mq = L.max_q, mc = L.max_ctx, nseg = int64_t(ac.segs.size());
          add("linear_chain",
              std::string(form == 0 ? "attn" : std::string(qf == QFormat::None ? "w16" : qformat_name(qf)) +
                                                   " qkv attn o") +
                  " " + ac.name + " b" + std::to_string(block) + " " + dims({nh, nkv, hd}),
              kAttn,
              {in("qkv", K::Act, randn(N * Qkv, 2.0)), in("wq", K::Act, randu(hd, 0.5, 1.5)),
               in("wk", K::Act, randu(hd, 0.5, 1.5)), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin),
               out("k_pool", K::Act, randn(L.pool_rows * nkv * hd)), out("v_pool", K::Act, randn(L.pool_rows * nkv * hd)),
               in("slots", K::I32, slots), in("cu", K::I32, L.cu), in("ctx", K::I32, L.ctx),
               in("table", K::I32, L.table), in("q", K::Act, randn(N * Dq)), out("att", K::Act, randn(N * Dq)),
               wqkv, sqkv, wo, so, in("norm1", K::Act, g1), in("scratch", K::Act, std::vector<double>(size_t(N * H))),
               out("x", K::Act, randn(N * H, 3.0))},
              [=](auto& x, auto& p, DType t) {
                const dev::ChainAttn a{p[1], p[2], P<float>(p, 3), P<float>(p, 4), p[5], p[6], P<int32_t>(p, 7),
                                       P<int32_t>(p, 8), P<int32_t>(p, 9), P<int32_t>(p, 10), mb, block, nseg, mq,
                                       mc, 0, nh, nkv, hd, 1e-6, float(1 / std::sqrt(double(hd))), p[11]};
                const auto sc = [&](int i) { return qf == QFormat::None ? nullptr : P<float>(p, i); };
                std::vector<dev::ChainLink> l;
                if (form == 1)
                  l.push_back({p[19], p[13], sc(14), p[0], H, Qkv, {nullptr, 1, false, p[18], p[17], 1e-6f}, false});
                dev::ChainLink at;
                at.in = p[0], at.y = p[12], at.attn = &a;
                l.push_back(at);
                if (form == 1) l.push_back({p[12], p[15], sc(16), p[19], Dq, H, {}, true});
                dev::linear_chain(x, l.data(), int(l.size()), N, qf, t);
              });
        }
  }

  // A decode step's MoE block as a chain link (dev::ChainMoe): x through the post-attention norm, routed, the picked
  // experts' SwiGLU MLPs combined and added to x; alone, and twice in one chain after o_proj (the second block's router
  // orders the experts the other way: other picks). On CUDA (bf16, fp16) one row is one persistent kernel where I's
  // 128-byte panels are a multiple of 4 (I 256, 512; gemv_chain.cuh's MoE jobs), else (I 192, two rows) the ops one by
  // one. The router's rows are c_e u plus noise and x leans on u, so the logits sit ~0.1 apart and the picks compare
  // exactly (idx); w and x within the chain's bounds.
  for (int64_t N : {1, 2})
    for (auto [H, E, k, I] : {std::array<int64_t, 4>{256, 16, 4, 256}, {384, 32, 8, 512}, {256, 16, 4, 192}})
      for (int form = 0; form < 2; ++form) {
        if (N == 2 && (form == 1 || I != 256)) continue;
        std::vector<double> u(static_cast<size_t>(H), 0.0), g = randn(H, 0.3), x0 = randn(N * H, 0.5);
        for (auto& v : u) v = std::bernoulli_distribution(0.5)(rng) ? 1.0 : -1.0;
        for (auto& v : g) v += 1.0;
        for (int64_t i = 0; i < N * H; ++i) x0[size_t(i)] += 2.0 * u[size_t(i % H)];
        const auto router = [&](bool reverse) {
          std::vector<double> c(static_cast<size_t>(E), 0.0), w = randn(E * H, 0.002);
          for (int64_t e = 0; e < E; ++e) c[size_t(e)] = double(reverse ? E - 1 - e : e) / double(E);
          std::shuffle(c.begin(), c.end(), rng);
          for (int64_t e = 0; e < E; ++e)
            for (int64_t i = 0; i < H; ++i) w[size_t(e * H + i)] += 4.0 * c[size_t(e)] * u[size_t(i)] / double(H);
          return w;
        };
        const std::vector<double> wr = router(false), wr2 = router(true);
        const int64_t R = N * k;
        add("linear_chain",
            std::string(form == 0 ? "moe" : "o moe o moe") + " " + dims({N, H, E, k, I}), kChain,
            {out("x", K::Act, x0), in("norm", K::Act, g), in("ln2", K::Act, std::vector<double>(size_t(N * H))),
             in("router", K::Act, wr), in("gate_up", K::Act, randn(E * 2 * I * H, 0.05)),
             in("down", K::Act, randn(E * H * I, 0.05)), in("logits", K::F32, std::vector<double>(size_t(N * E))),
             in("probs", K::F32, std::vector<double>(size_t(N * E))), out("w", K::F32, randu(R, 0, 1)),
             out("idx", K::I32, randi(R, E), true), in("start", K::I32, std::vector<double>(size_t(E + 1))),
             in("rows", K::I32, std::vector<double>(size_t(R))), in("pos", K::I32, std::vector<double>(size_t(R))),
             in("xg", K::Act, std::vector<double>(size_t(R * H))),
             in("egu", K::Act, std::vector<double>(size_t(R * 2 * I))),
             in("act", K::Act, std::vector<double>(size_t(R * I))), in("ey", K::Act, std::vector<double>(size_t(R * H))),
             in("att", K::Act, randn(N * H, 0.1)), in("w_o", K::Act, randn(H * H, 0.05)), in("router2", K::Act, wr2)},
            [=](auto& x, auto& p, DType t) {
              const auto moe = [&](int router) {
                return dev::ChainMoe{p[router], p[4], p[5], E, k, I, P<float>(p, 6), P<float>(p, 7), P<float>(p, 8),
                                     P<int32_t>(p, 9), P<int32_t>(p, 10), P<int32_t>(p, 11), P<int32_t>(p, 12),
                                     p[13], p[14], p[15], p[16]};
              };
              const dev::ChainMoe m1 = moe(3), m2 = moe(19);
              std::vector<dev::ChainLink> l;
              for (const dev::ChainMoe* m : {&m1, &m2}) {
                if (form == 1) l.push_back({p[17], p[18], nullptr, p[0], H, H, {}, true});
                l.push_back({p[0], nullptr, nullptr, p[0], H, H, {nullptr, 1, false, p[2], p[1], 1e-6f}, true});
                l.back().moe = m;
                if (form == 0) break;
              }
              dev::linear_chain(x, l.data(), int(l.size()), N, QFormat::None, t);
            });
      }

  // Weight-only 8-bit experts, int8 and fp8. Rows spread over the even experts (the odd ones have none) or all in
  // one; R <= 8 E is the CUDA GEMV over the experts with rows (R 40 and 64 with more than 16 rows an expert: several
  // passes), larger R dequantizes groups of experts into ws for the grouped GEMM ("ws2": room for two experts a group;
  // "ws0": for none, which falls back to the GEMV). n_in 256: 16-byte rows; 72: 4-byte; 102: neither.
  struct Experts {
    int64_t R, E;
    bool one;
    int ws;  // 0: the Exec's, 2: two experts, -1: none
  };
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8})
    for (auto [R, E, one, ws] : {Experts{1, 16, false, 0}, {4, 16, false, 0}, {8, 8, true, 0}, {18, 8, false, 0},
                                 {64, 128, false, 0},
                                 {64, 8, false, 0}, {40, 8, true, 0}, {300, 8, false, 0}, {300, 8, true, 0},
                                 {300, 8, false, 2}, {300, 8, false, -1}})
      for (auto [I, O] : {std::pair<int64_t, int64_t>{256, 96}, {72, 40}, {102, 37}}) {
        std::vector<double> ex = one ? std::vector<double>(size_t(R), double(E / 2)) : randi(R, (E + 1) / 2);
        if (!one)
          for (double& e : ex) e *= 2;
        std::sort(ex.begin(), ex.end());
        std::vector<uint8_t> q8;
        std::vector<float> sc;
        q8_weights(qf, E * O, I, q8, sc);
        add("grouped_linear_q8_fwd",
            std::string(qformat_name(qf)) + " " + dims({R, E, I, O}) + (one ? " one" : "") +
                (ws > 0 ? " ws2" : ws < 0 ? " ws0" : ""),
            kGemm,
            {in("xg", K::Act, randn(R * I)), in("q", K::I8, i8_values(q8)),
             in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())), in("start", K::I32, starts_of(ex, E)),
             out("y", K::Act, randn(R * O))},
            [=](auto& x, auto& p, DType t) {
              dev::Exec xs = x;
              if (ws)
                xs.ws_bytes = std::min<size_t>(x.ws_bytes, ws < 0 ? 4096 : 256 + 2 * size_t(O * I) * dtype_size(t));
              dev::grouped_linear_q8_fwd(xs, p[0], p[1], P<float>(p, 2), P<int32_t>(p, 3), p[4], R, E, I, O, qf, t);
            });
      }

  // Experts for the tensor-core GEMV: of 8, expert 1 holds 17 rows (two passes of 16), 4 two, 6 one, the rest none;
  // n_in 256, 1001 (scalar loads), 72; n_out 37.
  for (const QFormat qf : {QFormat::Int8, QFormat::Fp8})
    for (auto [I, O] : {std::pair<int64_t, int64_t>{256, 37}, {1001, 37}, {72, 37}}) {
      const int64_t R = 20, E = 8;
      std::vector<double> ex(17, 1.0);
      ex.insert(ex.end(), {4.0, 4.0, 6.0});
      std::vector<uint8_t> q8;
      std::vector<float> sc;
      q8_weights(qf, E * O, I, q8, sc);
      add("grouped_linear_q8_fwd", std::string(qformat_name(qf)) + " " + dims({R, E, I, O}) + " 17+2+1", kGemm,
          {in("xg", K::Act, randn(R * I)), in("q", K::I8, i8_values(q8)),
           in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())), in("start", K::I32, starts_of(ex, E)),
           out("y", K::Act, randn(R * O))},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_q8_fwd(x, p[0], p[1], P<float>(p, 2), P<int32_t>(p, 3), p[4], R, E, I, O, qf, t);
          });
      if (qf == QFormat::Fp8) continue;  // once in the activation dtype
      add("grouped_linear_fwd", dims({R, E, I, O}) + " 17+2+1", kGemm,
          {in("xg", K::Act, randn(R * I)), in("W", K::Act, randn(E * O * I, 0.1)),
           in("start", K::I32, starts_of(ex, E)), out("y", K::Act, randn(R * O))},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_fwd(x, p[0], p[1], P<int32_t>(p, 2), p[3], R, E, I, O, t);
          });
    }

  // "8 one": all 8 rows on one expert.
  // Experts in the activation dtype, rows spread as above. R <= 8 E is the CUDA GEMV over the experts with rows (the
  // int8 experts' GEMV on W in the activation dtype; R 40 and 64 with more than 16 rows an expert: several passes),
  // larger R the tiled grouped GEMM (65 x 8: just past the rule). n_in 256: 16-byte rows in every dtype; 72: also
  // (8 or 4 elements, 16 bytes, divide it); 102: scalar loads in every dtype; 2048: 16 staged rows take two chunks.
  for (auto [R, E, one] : {std::tuple<int64_t, int64_t, bool>{1, 16, false}, {8, 16, false}, {8, 8, true},
                           {18, 8, false}, {64, 128, false},
                           {64, 8, false}, {40, 8, true}, {65, 8, false}, {300, 8, false}, {300, 8, true}})
    for (auto [I, O] : {std::pair<int64_t, int64_t>{256, 96}, {72, 40}, {102, 37}, {2048, 48}}) {
      if (I == 2048 && !(R == 64 && E == 8)) continue;
      std::vector<double> ex = one ? std::vector<double>(size_t(R), double(E / 2)) : randi(R, (E + 1) / 2);
      if (!one)
        for (double& e : ex) e *= 2;
      std::sort(ex.begin(), ex.end());
      add("grouped_linear_fwd", dims({R, E, I, O}) + (one ? " one" : ""), kGemm,
          {in("xg", K::Act, randn(R * I)), in("W", K::Act, randn(E * O * I, 0.1)),
           in("start", K::I32, starts_of(ex, E)), out("y", K::Act, randn(R * O))},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_fwd(x, p[0], p[1], P<int32_t>(p, 2), p[3], R, E, I, O, t);
          });
    }

  // dev::RowsIn (the decode fusions): the experts' rows gathered from N tokens (row r: x[rows[r] / k], top-4) or the
  // SwiGLU of a [R, 2 I] gate|up input. 16-bit activations at R <= 8 E: the GEMV reads through them as it stages x;
  // every other path (fp32, R 160 > 8 E: the tiled GEMM or 8-bit dequantization) writes them to the scratch first.
  // n_in 256 and 102 (scalar loads); the dense 8-bit linear's SwiGLU at N 3 (the GEMV) and 40 (dequantize + GEMM).
  for (auto [N, E] : {std::pair<int64_t, int64_t>{1, 16}, {5, 8}, {40, 8}})
    for (auto [I, O] : {std::pair<int64_t, int64_t>{256, 40}, {102, 37}})
      for (bool swiglu : {false, true}) {
        const int64_t k = 4, R = N * k;
        std::vector<double> ex = randi(R, E), rows(static_cast<size_t>(R));
        std::sort(ex.begin(), ex.end());
        for (int64_t r = 0; r < R; ++r) rows[size_t(r)] = double((7 * r + 3) % R);  // a permutation: 7 is prime to R
        const std::string what = dims({R, E, I, O}) + (swiglu ? " swiglu" : " gather");
        auto rin = [=](auto& p, int rows_at) {
          return swiglu ? dev::RowsIn{nullptr, 1, true, p[rows_at + 1]}
                        : dev::RowsIn{P<int32_t>(p, rows_at), k, false, p[rows_at + 1]};
        };
        const auto x_in = in("x", K::Act, randn(swiglu ? R * 2 * I : N * I));
        const auto scratch = in("scratch", K::Act, std::vector<double>(size_t(R * I), 0.0));
        add("grouped_linear_fwd", what, kGemm,
            {x_in, in("W", K::Act, randn(E * O * I, 0.1)), in("start", K::I32, starts_of(ex, E)),
             in("rows", K::I32, rows), scratch, out("y", K::Act, randn(R * O))},
            [=](auto& x, auto& p, DType t) {
              dev::grouped_linear_fwd(x, p[0], p[1], P<int32_t>(p, 2), p[5], R, E, I, O, t, rin(p, 3));
            });
        for (const QFormat qf : {QFormat::Int8, QFormat::Fp8}) {
          std::vector<uint8_t> q8;
          std::vector<float> sc;
          q8_weights(qf, E * O, I, q8, sc);
          add("grouped_linear_q8_fwd", std::string(qformat_name(qf)) + " " + what, kGemm,
              {x_in, in("q", K::I8, i8_values(q8)), in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())),
               in("start", K::I32, starts_of(ex, E)), in("rows", K::I32, rows), scratch, out("y", K::Act, randn(R * O))},
              [=](auto& x, auto& p, DType t) {
                dev::grouped_linear_q8_fwd(x, p[0], p[1], P<float>(p, 2), P<int32_t>(p, 3), p[6], R, E, I, O, qf, t,
                                           rin(p, 4));
              });
          if (!swiglu || N == 1) continue;
          const int64_t M = N == 5 ? 3 : N;  // the dense linear: 3 rows (GEMV), 40 (GEMM)
          q8_weights(qf, O, I, q8, sc);
          add("linear_q8_fwd", std::string(qformat_name(qf)) + " " + dims({M, I, O}) + " swiglu", kGemm,
              {in("x", K::Act, randn(M * 2 * I)), in("q", K::I8, i8_values(q8)),
               in("scale", K::F32, std::vector<double>(sc.begin(), sc.end())),
               in("scratch", K::Act, std::vector<double>(size_t(M * I), 0.0)), out("y", K::Act, randn(M * O))},
              [=](auto& x, auto& p, DType t) {
                dev::linear_q8_fwd(x, p[0], p[1], P<float>(p, 2), nullptr, p[4], M, I, O, qf, t,
                                   dev::RowsIn{nullptr, 1, true, p[3]});
              });
        }
      }

  // The tiled grouped GEMM's tile edges, forward and backward: experts of 0, 400 (4 M tiles, the last partial), 1 and
  // 299 rows; n_out 304 and n_in 264 span two 256-wide N tiles (and DW's 3 M tiles of n_out), 16-byte rows and paired
  // stores; 301 x 262: scalar loads everywhere and unpaired stores where the output rows are odd (forward).
  for (auto [I, O] : {std::pair<int64_t, int64_t>{264, 304}, {262, 301}}) {
    const int64_t R = 700, E = 4;
    std::vector<double> ex(size_t(R), 3.0);
    std::fill(ex.begin(), ex.begin() + 400, 1.0);
    ex[400] = 2.0;
    add("grouped_linear_fwd", dims({R, E, I, O}) + " tiles", kGemm,
        {in("xg", K::Act, randn(R * I)), in("W", K::Act, randn(E * O * I, 0.1)), in("start", K::I32, starts_of(ex, E)),
         out("y", K::Act, randn(R * O))},
        [=](auto& x, auto& p, DType t) {
          dev::grouped_linear_fwd(x, p[0], p[1], P<int32_t>(p, 2), p[3], R, E, I, O, t);
        });
    for (auto [acc, acc_dw] : kGroupedBwdModes)
      add("grouped_linear_bwd", dims({R, E, I, O}) + " tiles" + mode(acc) + dw_mode(acc_dw), kGemm,
          {in("dy", K::Act, randn(R * O)), in("xg", K::Act, randn(R * I)), in("W", K::Act, randn(E * O * I, 0.1)),
           in("start", K::I32, starts_of(ex, E)), out("dxg", K::Act, randn(R * I)), out("dW", K::F32, randn(E * O * I))},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_bwd(x, p[0], p[1], p[2], P<int32_t>(p, 3), p[4], P<float>(p, 5), R, E, I, O, acc,
                                    acc_dw, t);
          });
    // A written dW with its sum of squares taken (dev::SumSq; the training step's gradient norm): onto a prior sum,
    // and with one +Inf in dy (row 5 of expert 0, column 7), which makes row 7 of dW[0] infinite (counted, not
    // summed) and leaves the rest finite (the wgmma epilogue's slow path; zeros past the tiles' edges times the Inf
    // must not count).
    for (bool inf : {false, true}) {
      auto dy = randn(R * O);
      if (inf) dy[size_t(5 * O + 7)] = INFINITY;
      add("grouped_linear_bwd", dims({R, E, I, O}) + " tiles din= dW= sq" + (inf ? " inf" : ""), kGemm,
          {in("dy", K::Act, dy), in("xg", K::Act, randn(R * I)), in("W", K::Act, randn(E * O * I, 0.1)),
           in("start", K::I32, starts_of(ex, E)), out("dxg", K::Act, randn(R * I)), out("dW", K::F32, randn(E * O * I)),
           out("sq", K::F64, {2.5}), out("bad", K::I32, {3}, true)},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_bwd(x, p[0], p[1], p[2], P<int32_t>(p, 3), p[4], P<float>(p, 5), R, E, I, O, false,
                                    false, t, {P<double>(p, 6), P<int32_t>(p, 7)});
          });
    }
  }

  // norms (D = 128: QK-norm rows; 1152: the vision width, and with 1030 (unaligned) few rows: a block per row; 200: odd)
  for (auto [N, D] : {std::pair<int64_t, int64_t>{33, 200}, {528, 128}, {7, 1152}, {5, 1030}}) {
    add("rmsnorm_fwd", dims({N, D}), kReduce,
        {in("x", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)), out("y", K::Act, randn(N * D)),
         out("rstd", K::F32, randn(N))},
        [=](auto& x, auto& p, DType t) { dev::rmsnorm_fwd(x, p[0], p[1], p[2], P<float>(p, 3), N, D, 1e-6, t); });
    // Serving's (add, no copy), training's mid-layer (add and copy) and layer start (copy only).
    for (auto [add_a, save] : {std::pair{true, false}, {true, true}, {false, true}})
      add("residual_rmsnorm_fwd", dims({N, D}) + (add_a ? "" : " no-add") + (save ? " saved" : ""), kReduce,
          {in("a", K::Act, randn(N * D)), out("io", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)),
           out("y", K::Act, randn(N * D)), out("saved", K::Act, randn(N * D)), out("rstd", K::F32, randn(N))},
          [=](auto& x, auto& p, DType t) {
            dev::residual_rmsnorm_fwd(x, add_a ? p[0] : nullptr, p[1], p[2], p[3], save ? p[4] : nullptr,
                                      P<float>(p, 5), N, D, 1e-6, t);
          });
    for (bool acc : {true, false})
      add("rmsnorm_bwd", dims({N, D}) + mode(acc), kReduce,
          {in("dy", K::Act, randn(N * D)), in("x", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)),
           in("rstd", K::F32, randu(N, 0.5, 2)), out("dx", K::Act, randn(N * D)), out("dw", K::F32, randn(D))},
          [=](auto& x, auto& p, DType t) {
            dev::rmsnorm_bwd(x, p[0], p[1], p[2], P<float>(p, 3), p[4], P<float>(p, 5), N, D, acc, t);
          });
    add("layernorm_fwd", dims({N, D}), kReduce,
        {in("x", K::Act, randn(N * D, 3)), in("w", K::Act, randu(D, 0.5, 1.5)), in("b", K::Act, randn(D)),
         out("y", K::Act, randn(N * D)), out("mean", K::F32, randn(N)), out("rstd", K::F32, randn(N))},
        [=](auto& x, auto& p, DType t) {
          dev::layernorm_fwd(x, p[0], p[1], p[2], p[3], P<float>(p, 4), P<float>(p, 5), N, D, 1e-6, t);
        });
    for (bool acc : {true, false})
      add("layernorm_bwd", dims({N, D}) + mode(acc), kReduce,
          {in("dy", K::Act, randn(N * D)), in("x", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)),
           in("mean", K::F32, randn(N, 0.1)), in("rstd", K::F32, randu(N, 0.5, 2)), out("dx", K::Act, randn(N * D)),
           out("dw", K::F32, randn(D)), out("db", K::F32, randn(D))},
          [=](auto& x, auto& p, DType t) {
            dev::layernorm_bwd(x, p[0], p[1], p[2], P<float>(p, 3), P<float>(p, 4), p[5], P<float>(p, 6),
                               P<float>(p, 7), N, D, acc, t);
          });
  }

  // The norms' row-group kernels at more rows: the backwards' column sums then span several chunks (k_chunk_sum adds
  // their partials). 4096 x 128: the QK-norm rows (8 rows a warp); 1152 and 2048: the vision and text widths (784 x
  // 1152: the 30B-A3B vision tower's rows, 196 chunks of 4); 9001 x 2048: past the 512-chunk cap as the text model's
  // 13399-16384 rows are (501 chunks of 18 rows, the last of one); 1030 (unaligned: scalar loads) over many rows;
  // 2050: wider than the scalar row groups hold (dx a warp a row, the column sums over two slices); 9000: wider than
  // the 16-byte ones hold. "dw=null": frozen weights (dx alone); "ws0": no workspace (one chunk, adding into dw/db
  // itself).
  struct NormCase {
    int64_t N, D;
    bool weights = true, ws = true;
  };
  for (auto [N, D, weights, ws] :
       {NormCase{4096, 128}, {784, 1152}, {300, 2048}, {9001, 2048}, {1000, 1030}, {64, 2050}, {16, 9000},
        {4096, 128, false}, {784, 1152, false}, {300, 2048, true, false}}) {
    const std::string tag = dims({N, D}) + (weights ? "" : " dw=null") + (ws ? "" : " ws0");
    auto exec = [ws](const dev::Exec& x) {
      dev::Exec xs = x;
      if (!ws) xs.ws_bytes = 0;
      return xs;
    };
    for (bool acc : {true, false}) {
      add("rmsnorm_bwd", tag + mode(acc), kReduce,
          {in("dy", K::Act, randn(N * D)), in("x", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)),
           in("rstd", K::F32, randu(N, 0.5, 2)), out("dx", K::Act, randn(N * D)), out("dw", K::F32, randn(D))},
          [=](auto& x, auto& p, DType t) {
            dev::rmsnorm_bwd(exec(x), p[0], p[1], p[2], P<float>(p, 3), p[4], weights ? P<float>(p, 5) : nullptr, N,
                             D, acc, t);
          });
      add("layernorm_bwd", tag + mode(acc), kReduce,
          {in("dy", K::Act, randn(N * D)), in("x", K::Act, randn(N * D)), in("w", K::Act, randu(D, 0.5, 1.5)),
           in("mean", K::F32, randn(N, 0.1)), in("rstd", K::F32, randu(N, 0.5, 2)), out("dx", K::Act, randn(N * D)),
           out("dw", K::F32, randn(D)), out("db", K::F32, randn(D))},
          [=](auto& x, auto& p, DType t) {
            dev::layernorm_bwd(exec(x), p[0], p[1], p[2], P<float>(p, 3), P<float>(p, 4), p[5],
                               weights ? P<float>(p, 6) : nullptr, weights ? P<float>(p, 7) : nullptr, N, D, acc, t);
          });
    }
    if (weights && ws)
      add("layernorm_fwd", tag, kReduce,
          {in("x", K::Act, randn(N * D, 3)), in("w", K::Act, randu(D, 0.5, 1.5)), in("b", K::Act, randn(D)),
           out("y", K::Act, randn(N * D)), out("mean", K::F32, randn(N)), out("rstd", K::F32, randn(N))},
          [=](auto& x, auto& p, DType t) {
            dev::layernorm_fwd(x, p[0], p[1], p[2], p[3], P<float>(p, 4), P<float>(p, 5), N, D, 1e-6, t);
          });
  }

  // rotary: rope_fwd / rope_bwd over H heads, qk_norm_rope_fwd over nh query and nkv kv heads, with the tables r
  const auto add_rope_fwd = [&](int64_t N, int64_t H, int64_t hd, const Rotary& r) {
    add("rope_fwd", dims({N, H, hd}), kElem,
        {out("x", K::Act, randn(N * H * hd)), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin)},
        [=](auto& x, auto& p, DType t) { dev::rope_fwd(x, p[0], P<float>(p, 1), P<float>(p, 2), N, H, hd, t); });
  };
  const auto add_rope_bwd = [&](int64_t N, int64_t H, int64_t hd, const Rotary& r) {
    add("rope_bwd", dims({N, H, hd}), kElem,
        {out("dx", K::Act, randn(N * H * hd)), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin)},
        [=](auto& x, auto& p, DType t) { dev::rope_bwd(x, p[0], P<float>(p, 1), P<float>(p, 2), N, H, hd, t); });
  };
  const auto add_qk_norm_rope = [&](int64_t N, int64_t nh, int64_t nkv, int64_t hd, const Rotary& r) {
    add("qk_norm_rope_fwd", dims({N, nh, nkv, hd}), kReduce,
        {in("qraw", K::Act, randn(N * nh * hd)), in("kraw", K::Act, randn(N * nkv * hd)),
         in("wq", K::Act, randu(hd, 0.5, 1.5)), in("wk", K::Act, randu(hd, 0.5, 1.5)),
         out("q", K::Act, randn(N * nh * hd)), out("k", K::Act, randn(N * nkv * hd)), out("rq", K::F32, randn(N * nh)),
         out("rk", K::F32, randn(N * nkv)), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin)},
        [=](auto& x, auto& p, DType t) {
          dev::qk_norm_rope_fwd(x, p[0], p[1], p[2], p[3], p[4], p[5], P<float>(p, 6), P<float>(p, 7), P<float>(p, 8),
                                P<float>(p, 9), N, nh, nkv, hd, 1e-6, t);
        });
  };
  // qk_norm_rope_bwd: the text model's heads (16 query, 8 kv) at head dims 128 and 64 over N tokens. 1 and 7: each
  // kind's column sums one block's, added to dw itself; 9: q's two chunks, k's one; 23, 600: several chunks each
  // (k_chunk_sum). "ws0": no workspace (one chunk each however many rows); "dw=null": frozen norms. 72 and 20 (4/2
  // heads): shapes the kernel does not take (rope_bwd and rmsnorm_bwd). kReduce: the kernel keeps the rotated
  // gradient in fp32, as the fp32 reference does, so only the summation order and the outputs' rounding differ; the
  // two-op path rounds it to dt, about one 16-bit ulp of each input of rmsnorm_bwd, well within kReduce too.
  // "fused": qraw, kraw, dqr and dkr as training's fused rows q | k | v (ld = (nh + 2 nkv) hd; the v columns are
  // neither read nor written: they keep their random values, which the comparison checks).
  const auto add_qk_norm_rope_bwd = [&](int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool acc,
                                        const std::string& what, bool weights = true, bool ws = true,
                                        bool fused = false) {
    const Rotary r = rotary(N, hd);
    const int64_t nq = N * nh * hd, nk = N * nkv * hd, ld = fused ? (nh + 2 * nkv) * hd : 0;
    const int64_t nraw = fused ? N * ld : nq, koff = fused ? nh * hd : 0;
    add("qk_norm_rope_bwd", dims({N, nh, nkv, hd}) + what + (fused ? " fused rows" : "") + mode(acc), kReduce,
        {in("dq", K::Act, randn(nq)), in("dk", K::Act, randn(nk)), in("qraw", K::Act, randn(nraw)),
         in("kraw", K::Act, randn(fused ? 1 : nk)), in("wq", K::Act, randu(hd, 0.5, 1.5)),
         in("wk", K::Act, randu(hd, 0.5, 1.5)), in("rq", K::F32, randu(N * nh, 0.5, 2)),
         in("rk", K::F32, randu(N * nkv, 0.5, 2)), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin),
         out("dqr", K::Act, randn(nraw)), out("dkr", K::Act, randn(fused ? 1 : nk)), out("dwq", K::F32, randn(hd)),
         out("dwk", K::F32, randn(hd))},
        [=](auto& x, auto& p, DType t) {
          dev::Exec xs = x;
          if (!ws) xs.ws_bytes = 0;
          const auto col = [&](void* b) -> void* { return static_cast<char*>(b) + koff * int64_t(dtype_size(t)); };
          const void* kraw = fused ? col(p[2]) : p[3];
          void* dkr = fused ? col(p[10]) : p[11];
          dev::qk_norm_rope_bwd(xs, p[0], p[1], p[2], kraw, p[4], p[5], P<float>(p, 6), P<float>(p, 7),
                                P<float>(p, 8), P<float>(p, 9), p[10], dkr, weights ? P<float>(p, 12) : nullptr,
                                weights ? P<float>(p, 13) : nullptr, N, nh, nkv, hd, ld, acc, t);
        });
  };
  for (bool acc : {false, true}) {
    for (int64_t hd : {128, 64})
      for (int64_t N : {1, 7, 9, 23, 600}) add_qk_norm_rope_bwd(N, 16, 8, hd, acc, "");
    for (int64_t hd : {72, 20}) add_qk_norm_rope_bwd(23, 4, 2, hd, acc, " two ops");
    for (int64_t N : {1, 23, 600}) add_qk_norm_rope_bwd(N, 16, 8, 128, acc, "", true, true, true);
  }
  add_qk_norm_rope_bwd(9, 4, 2, 64, false, "", true, true, true);
  add_qk_norm_rope_bwd(600, 16, 8, 128, false, " ws0", true, false);
  add_qk_norm_rope_bwd(600, 16, 8, 128, false, " dw=null", false);
  // QK-norm rows past those below: the text model's heads over more tokens, and head dims whose halves take 8-byte
  // vectors (20, fp32) or none (6: the warp-a-row kernel).
  for (auto [N, nh, nkv, hd] : {std::array<int64_t, 4>{600, 16, 8, 128}, {23, 4, 2, 20}, {23, 4, 2, 6}})
    add_qk_norm_rope(N, nh, nkv, hd, rotary(N, hd));
  // rotary, each head dim
  for (int64_t hd : {64, 72, 128}) {
    const int64_t N = 23, H = 3;
    const Rotary r = rotary(N, hd);
    add_rope_fwd(N, H, hd, r);
    for (auto [nh, nkv] : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}}) add_qk_norm_rope(N, nh, nkv, hd, r);
    {  // serving's fused projection rows into q and the pools: 4 query heads, 2 kv heads, slots shuffled, two -1
      const int64_t nh = 4, nkv = 2, Dk = nkv * hd, rows = 3 * N;
      std::vector<double> slots(rows);
      std::iota(slots.begin(), slots.end(), 0.0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(N);
      slots[2] = slots[9] = -1;
      add("qkv_to_cache_fwd", dims({N, nh, nkv, hd}), kReduce,
          {in("qkv", K::Act, randn(N * (nh + 2 * nkv) * hd)), in("wq", K::Act, randu(hd, 0.5, 1.5)),
           in("wk", K::Act, randu(hd, 0.5, 1.5)), out("q", K::Act, randn(N * nh * hd)),
           out("k_pool", K::Act, randn(rows * Dk)), out("v_pool", K::Act, randn(rows * Dk)),
           in("slots", K::I32, slots), in("cos", K::F32, r.cos), in("sin", K::F32, r.sin)},
          [=](auto& x, auto& p, DType t) {
            dev::qkv_to_cache_fwd(x, p[0], p[1], p[2], p[3], p[4], p[5], P<int32_t>(p, 6), nullptr, nullptr,
                                  P<float>(p, 7), P<float>(p, 8), N, nh, nkv, hd, 1e-6, t);
          });
    }
    {  // training's: no slots, k and v [N, nkv, hd] in row order, with the rows' rstd
      const int64_t nh = 4, nkv = 2, Dk = nkv * hd;
      add("qkv_to_cache_fwd", dims({N, nh, nkv, hd}) + " training", kReduce,
          {in("qkv", K::Act, randn(N * (nh + 2 * nkv) * hd)), in("wq", K::Act, randu(hd, 0.5, 1.5)),
           in("wk", K::Act, randu(hd, 0.5, 1.5)), out("q", K::Act, randn(N * nh * hd)), out("k", K::Act, randn(N * Dk)),
           out("v", K::Act, randn(N * Dk)), out("rq", K::F32, randn(N * nh)), out("rk", K::F32, randn(N * nkv)),
           in("cos", K::F32, r.cos), in("sin", K::F32, r.sin)},
          [=](auto& x, auto& p, DType t) {
            dev::qkv_to_cache_fwd(x, p[0], p[1], p[2], p[3], p[4], p[5], nullptr, P<float>(p, 6), P<float>(p, 7),
                                  P<float>(p, 8), P<float>(p, 9), N, nh, nkv, hd, 1e-6, t);
          });
    }
    add_rope_bwd(N, H, hd, r);
  }

  // rotary at half head dims 10 and 9: two pairs a thread, one
  for (int64_t hd : {20, 18}) {
    const int64_t N = 5, H = 2;
    const Rotary r = rotary(N, hd);
    add_rope_fwd(N, H, hd, r);
    add_rope_bwd(N, H, hd, r);
  }

  // rotary tables from positions (dtype-free: F32 out, within an ulp whatever dt): the text's M-RoPE over 3 axes at
  // positions up to 40000 (angles to 4e4 rad: the CUDA sines must reduce them as the CPU's do), the vision tower's
  // 2-D tables at head dims 64 and 72.
  {
    const int64_t N = 1000, hd = 128, W = hd / 2;
    const int section[3] = {24, 20, 20};
    std::vector<int> axis(W);
    std::vector<float> freq(W);
    ops::mrope_cols(hd, 5e6, section, axis.data(), freq.data());
    add("rope_table", "text " + dims({N, W}), kTable,
        {in("pos", K::I32, randi(3 * N, 40000)), out("cos", K::F32, randn(N * W)), out("sin", K::F32, randn(N * W))},
        [=](auto& x, auto& p, DType) {
          dev::rope_table(x, P<int32_t>(p, 0), N, W, axis.data(), freq.data(), P<float>(p, 1), P<float>(p, 2));
        });
  }
  for (int64_t hd : {64, 72}) {
    const int64_t N = 784, W = hd / 2;
    std::vector<int> axis(W);
    std::vector<float> freq(W);
    ops::vision_rope_cols(hd, axis.data(), freq.data());
    add("rope_table", "vision " + dims({N, W}), kTable,
        {in("pos", K::I32, randi(2 * N, 64)), out("cos", K::F32, randn(N * W)), out("sin", K::F32, randn(N * W))},
        [=](auto& x, auto& p, DType) {
          dev::rope_table(x, P<int32_t>(p, 0), N, W, axis.data(), freq.data(), P<float>(p, 1), P<float>(p, 2));
        });
  }

  // attention: packed segments of odd lengths (a single token, under and over a block), GQA and MHA, both masks
  for (int64_t hd : {64, 72, 128})
    for (auto [nh, nkv] : {std::pair<int64_t, int64_t>{4, 2}, {2, 2}})
      for (bool causal : {true, false}) {
        const std::vector<int64_t> lens{1, 37, 64, 130};
        const int64_t N = 232, nseg = 4, maxl = 130;
        const float sc = float(1 / std::sqrt(double(hd)));
        const std::string sh = "seg{1,37,64,130} " + dims({nh, nkv, hd}) + (causal ? " causal" : " full");
        add("attention_fwd", sh, kAttn,
            {in("q", K::Act, randn(N * nh * hd)), in("k", K::Act, randn(N * nkv * hd)),
             in("v", K::Act, randn(N * nkv * hd)), out("out", K::Act, randn(N * nh * hd)),
             out("lse", K::F32, randn(N * nh)), in("cu", K::I32, cu_of(lens))},
            [=](auto& x, auto& p, DType t) {
              dev::attention_fwd(x, p[0], p[1], p[2], p[3], P<float>(p, 4), P<int32_t>(p, 5), nseg, maxl, N, nh, nkv,
                                 hd, causal, sc, t);
            });
        // The backward's out and lse must be the forward's: computed here by the CPU reference in fp32.
        auto q = randn(N * nh * hd), k = randn(N * nkv * hd), v = randn(N * nkv * hd);
        std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end()), of(q.size()),
            lf(N * nh);
        std::vector<int64_t> cu64{0, 1, 38, 102, 232};
        ops::attention_fwd(qf.data(), kf.data(), vf.data(), of.data(), lf.data(), cu64.data(), nseg, nh, nkv, hd,
                           causal, sc);
        for (bool acc : {true, false})
          add("attention_bwd", sh + mode(acc), kAttn,
              {in("dout", K::Act, randn(N * nh * hd)), in("q", K::Act, q), in("k", K::Act, k), in("v", K::Act, v),
               in("out", K::Act, {of.begin(), of.end()}), in("lse", K::F32, {lf.begin(), lf.end()}),
               out("dq", K::Act, randn(N * nh * hd)), out("dk", K::Act, randn(N * nkv * hd)),
               out("dv", K::Act, randn(N * nkv * hd)), in("cu", K::I32, cu_of(lens))},
              [=](auto& x, auto& p, DType t) {
                dev::attention_bwd(x, p[0], p[1], p[2], p[3], p[4], P<float>(p, 5), p[6], p[7], p[8],
                                   P<int32_t>(p, 9), nseg, maxl, N, nh, nkv, hd, causal, sc, acc, t);
              });
      }

  // paged attention: decode rows (context 1 and 700), a fresh prompt of 37, a chunk of 64 continuing 200 tokens, in one
  // call; shuffled block tables over a pool of random values; then decode-only calls with long contexts (split keys on
  // the GPU), an odd block size with hd 16, and longer prefill chunks (the tensor-core path for bf16/fp16).
  {
    using Segs = std::vector<std::pair<int64_t, int64_t>>;
    auto paged = [&](const std::string& name, const Segs& segs, int64_t block, int64_t nh, int64_t nkv, int64_t hd,
                     int64_t cap = 0) {
      const Paged L = paged_layout(segs, block, 5, cap);
      const float sc = float(1 / std::sqrt(double(hd)));
      const int64_t N = L.N, mb = L.max_blocks, nseg = int64_t(segs.size()), mq = L.max_q, mc = L.max_ctx;
      add("paged_attention_fwd", name + " b" + std::to_string(block) + " " + dims({nh, nkv, hd}), kAttn,
          {in("q", K::Act, randn(N * nh * hd)), in("k_pool", K::Act, randn(L.pool_rows * nkv * hd)),
           in("v_pool", K::Act, randn(L.pool_rows * nkv * hd)), out("out", K::Act, randn(N * nh * hd)),
           in("cu", K::I32, L.cu), in("ctx", K::I32, L.ctx), in("table", K::I32, L.table)},
          [=](auto& x, auto& p, DType t) {
            dev::paged_attention_fwd(x, p[0], p[1], p[2], p[3], P<int32_t>(p, 4), P<int32_t>(p, 5), P<int32_t>(p, 6),
                                     mb, block, nseg, mq, mc, 0, N, nh, nkv, hd, sc, t);
          });
    };
    const Segs mixed{{1, 1}, {1, 700}, {37, 37}, {64, 264}};
    for (int64_t block : {16, 32})
      for (auto [nh, nkv] : {std::pair<int64_t, int64_t>{4, 2}, {8, 1}, {2, 2}})
        for (int64_t hd : {64, 72, 128}) paged("n/ctx{1/1,1/700,37/37,64/264}", mixed, block, nh, nkv, hd);
    const Segs decode{{1, 5000}, {1, 1}, {1, 3333}, {1, 17}};
    paged("decode ctx{5000,1,3333,17}", decode, 16, 8, 1, 128);
    paged("decode ctx{5000,1,3333,17}", decode, 32, 4, 2, 64);
    paged("decode ctx{5000,1,3333,17}", decode, 16, 2, 2, 72);
    // as serving's graph-captured decode steps: max_ctx is the table's capacity, each split sized on the device
    paged("decode ctx{300,1,17,2000} max_ctx 8192", {{1, 300}, {1, 1}, {1, 17}, {1, 2000}}, 16, 8, 2, 128, 8192);
    paged("decode ctx{300,1,17,2000} max_ctx 8192", {{1, 300}, {1, 1}, {1, 17}, {1, 2000}}, 16, 4, 4, 64, 8192);
    paged("n/ctx{3/40,1/9,20/20}", {{3, 40}, {1, 9}, {20, 20}}, 5, 4, 2, 16);
    paged("n/ctx{700/1000,1/300}", {{700, 1000}, {1, 300}}, 16, 4, 1, 64);
    // the 8B's group (4 query heads a kv head) at hd 128: several tiles of the tensor-core prefill kernel
    paged("n/ctx{150/600,1/650,40/40}", {{150, 600}, {1, 650}, {40, 40}}, 16, 8, 2, 128);
  }

  // embeddings and row moves (ids repeat: the backward accumulates)
  {
    const int64_t N = 40, D = 64, V = 50;
    add("embedding_fwd", dims({N, D, V}), kElem,
        {in("ids", K::I32, randi(N, V)), in("table", K::Act, randn(V * D)), out("y", K::Act, randn(N * D))},
        [=](auto& x, auto& p, DType t) { dev::embedding_fwd(x, P<int32_t>(p, 0), p[1], p[2], N, D, V, t); });
    add("embedding_bwd", dims({N, D, V}), kReduce,
        {in("ids", K::I32, randi(N, V)), in("dy", K::Act, randn(N * D)), out("dtable", K::F32, randn(V * D))},
        [=](auto& x, auto& p, DType t) { dev::embedding_bwd(x, P<int32_t>(p, 0), p[1], P<float>(p, 2), N, D, t); });
    for (int64_t div : {1, 4}) {
      const int64_t R = 30, S = 60;
      add("gather_rows", dims({R, D}) + " div " + std::to_string(div), kElem,
          {in("src", K::Act, randn(S * D)), in("rows", K::I32, randi(R, S * div)), out("dst", K::Act, randn(R * D))},
          [=](auto& x, auto& p, DType t) { dev::gather_rows(x, p[0], P<int32_t>(p, 1), div, p[2], R, D, t); });
    }
    // a column block of one matrix's rows into another's (training's dv into the fused q | k | v gradient rows): 16-byte
    // moves, and odd strides and widths (2- or 4-byte moves)
    for (auto [C, lds, ldd] : {std::array<int64_t, 3>{D, D + 24, 3 * D}, {D - 1, D + 3, 2 * D + 5}}) {
      const int64_t R = 30;
      add("copy_2d", dims({R, C, lds, ldd}), kElem,
          {in("src", K::Act, randn(R * lds)), out("dst", K::Act, randn(R * ldd))},
          [=](auto& x, auto& p, DType t) {
            dev::copy_2d(x, p[0], lds, static_cast<char*>(p[1]) + D * int64_t(dtype_size(t)), ldd, R, C, t);
          });
    }
    for (bool acc : {false, true}) {
      const int64_t R = 25, S = 70;
      std::vector<double> rows(S);
      std::iota(rows.begin(), rows.end(), 0.0);
      std::shuffle(rows.begin(), rows.end(), rng);
      rows.resize(R);
      rows[3] = rows[17] = -1;  // skipped: a padded decode row's KV slot
      add("scatter_rows", dims({R, D}) + (acc ? " +=" : " ="), kElem,
          {in("src", K::Act, randn(R * D)), in("rows", K::I32, rows), out("dst", K::Act, randn(S * D))},
          [=](auto& x, auto& p, DType t) { dev::scatter_rows(x, p[0], P<int32_t>(p, 1), p[2], R, D, acc, t); });
    }
    for (auto [tt, h, w] : {std::tuple<int64_t, int64_t, int64_t>{1, 4, 6}, {2, 8, 4}}) {
      const int64_t G = 6, Dp = 32, n = tt * h * w;
      add("pos_embed_fwd", dims({tt, h, w, Dp}), kReduce,
          {in("table", K::Act, randn(G * G * Dp)), out("y", K::Act, randn(n * Dp))},
          [=](auto& x, auto& p, DType t) { dev::pos_embed_fwd(x, p[0], G, Dp, tt, h, w, 2, p[1], t); });
      add("pos_embed_bwd", dims({tt, h, w, Dp}), kReduce,
          {in("dy", K::Act, randn(n * Dp)), out("dtable", K::F32, randn(G * G * Dp))},
          [=](auto& x, auto& p, DType t) { dev::pos_embed_bwd(x, p[0], G, Dp, tt, h, w, 2, P<float>(p, 1), t); });
    }
  }

  // cross-entropy, up to Qwen's vocabulary; some rows ignored
  // The CPU reference sums a row's exps one by one in fp32: over Qwen's 151936 logits that sum drifts by ~2e-4
  // relative (its rounding is biased as it grows), so the reference, not the kernel, is off by up to ~2e-4 normalised
  // (1.57e-4 measured on the H200, 2026-12-02): fp32's bound is 3e-4 there. Summing in double would fix the reference
  // but changes the CPU's training numerics, and make demo's recipe then misses its star/triangle bar (85%).
  for (auto [N, V] : {std::pair<int64_t, int64_t>{13, 1000}, {5, 151936}}) {
    auto tg = randi(N, V);
    tg[1] = -100;
    for (bool acc : {true, false})
      add("cross_entropy", dims({N, V}) + mode(acc), V > 100000 ? Tol{3e-4, 5e-3, 2e-2} : kReduce,
          {in("logits", K::Act, randn(N * V, 3)), in("target", K::I32, tg), out("loss", K::F32, randn(N)),
           out("dlogits", K::Act, randn(N * V, acc ? 1e-4 : 1.0)), out("sum", K::F64, {0.25})},
          [=](auto& x, auto& p, DType t) {
            dev::cross_entropy(x, p[0], P<int32_t>(p, 1), P<float>(p, 2), p[3], P<double>(p, 4), N, V, 0.125f, acc,
                               t);
          });
  }

  // Greedy argmax over F32 logits (serve's greedy steps): ties (the row maximum copied to a later column, which must
  // lose), a banned maximum, a vocabulary limit inside the slice, a slice starting at v0, a row with nothing allowed.
  // CUDA reads rows as float4s where V % 4 == 0 (a limit not a multiple of 4 ends in single loads); 1001: single only.
  for (auto [S, V, v0, limit] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 1000, 0, 1000}, {5, 151936, 0, 151643},
                                 {6, 700, 300, 900}, {3, 64, 500, 400}, {4, 1001, 0, 1001}}) {
    std::vector<double> lg = randn(S * V, 3);
    for (int64_t i = 0; i < S && V > 20; ++i) {
      const int64_t m = std::max_element(lg.begin() + i * V, lg.begin() + (i + 1) * V) - (lg.begin() + i * V);
      if (i % 2 == 0) lg[i * V + (m + 7) % V] = lg[i * V + m] + (i % 4 == 0 ? 0.0 : 1.0);  // a tie, or a new max
    }
    const std::vector<double> banned = {double(v0 + 10), double(v0 + 11), 151655, double(v0 + 3)};
    for (int64_t i = 0; i < S; ++i) lg[i * V + std::min<int64_t>(V - 1, 10)] = 99;  // banned when v0 + 10 is
    add("argmax_rows", dims({S, V, v0, limit}), kElem,
        {in("logits", K::F32, lg), in("banned", K::I32, banned), out("idx", K::I32, randi(S, 9), true),
         out("val", K::F32, randn(S))},
        [=](auto& x, auto& p, DType) {
          dev::argmax_rows(x, P<float>(p, 0), S, V, v0, limit, P<int32_t>(p, 1), 4, P<int32_t>(p, 2), P<float>(p, 3));
        });
  }

  // moe_plan at serving's shapes: one block (64 x top-8 of 128, a decode step; 2048 pairs, the one-block limit) and
  // the three-pass plan (5600 pairs; 1000 experts, whose counts do not fit the one block's shared memory).
  for (auto [N, E, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 128, 8}, {256, 128, 8}, {700, 128, 8},
                         {300, 1000, 2}}) {
    add("moe_plan", dims({N, E, k}), kElem,
        {in("idx", K::I32, randi(N * k, E)), out("start", K::I32, randi(E + 1, 9), true),
         out("rows", K::I32, randi(N * k, 9), true), out("pos", K::I32, randi(N * k, 9), true)},
        [=](auto& x, auto& p, DType) {
          dev::moe_plan(x, P<int32_t>(p, 0), N, k, E, P<int32_t>(p, 1), P<int32_t>(p, 2), P<int32_t>(p, 3));
        });
  }

  // moe_route (the router GEMM, router_fwd and moe_plan in one op) at decode shapes of the 30B-A3B (CUDA: the fused
  // cluster kernel up to 16 rows, the three launches at 64) and a small odd one (two experts a block of the
  // cluster); the logits exact (route_inputs), so the indices compare exactly. Once without logits (not written; the
  // CPU keeps its own).
  for (auto [N, H, E, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 2048, 128, 8}, {8, 2048, 128, 8},
                            {16, 2048, 128, 8}, {64, 2048, 128, 8}, {9, 72, 16, 4}}) {
    std::vector<double> xv, wv;
    route_inputs(N, H, E, k, xv, wv);
    for (bool keep : {true, false}) {
      if (!keep && N != 8) continue;
      std::vector<Arg> args{in("x", K::Act, xv), in("Wr", K::Act, wv), out("probs", K::F32, randn(N * E)),
                            out("idx", K::I32, randi(N * k, E), true), out("w", K::F32, randn(N * k)),
                            out("start", K::I32, randi(E + 1, 9), true), out("rows", K::I32, randi(N * k, 9), true),
                            out("pos", K::I32, randi(N * k, 9), true)};
      if (keep) args.push_back(out("logits", K::F32, randn(N * E)));
      add("moe_route", dims({N, H, E, k}) + (keep ? "" : " logits=null"), kReduce, args,
          [=](auto& x, auto& p, DType t) {
            dev::moe_route(x, p[0], p[1], keep ? P<float>(p, 8) : nullptr, P<float>(p, 2), P<int32_t>(p, 3),
                           P<float>(p, 4), P<int32_t>(p, 5), P<int32_t>(p, 6), P<int32_t>(p, 7), N, H, E, k, t);
          });
    }
  }

  // MoE: router, aux loss, buckets, grouped GEMMs, combine
  for (auto [N, E, k] : {std::tuple<int64_t, int64_t, int64_t>{31, 16, 4}, {9, 8, 2}}) {
    add("router_fwd", dims({N, E, k}), kReduce,
        {in("logits", K::Act, randn(N * E, 2)), out("probs", K::F32, randn(N * E)),
         out("idx", K::I32, randi(N * k, E), true), out("w", K::F32, randn(N * k))},
        [=](auto& x, auto& p, DType t) {
          dev::router_fwd(x, p[0], P<float>(p, 1), P<int32_t>(p, 2), P<float>(p, 3), N, E, k, t);
        });
    std::vector<double> probs, idx, start, pos;
    route(N, E, k, probs, idx);
    for (bool acc : {true, false})
      add("router_bwd", dims({N, E, k}) + mode(acc), kReduce,
          {in("dw", K::F32, randn(N * k)), in("probs", K::F32, probs), in("idx", K::I32, idx),
           out("dlogits", K::Act, randn(N * E))},
          [=](auto& x, auto& p, DType t) {
            dev::router_bwd(x, P<float>(p, 0), P<float>(p, 1), P<int32_t>(p, 2), p[3], N, E, k, acc, t);
          });
    add("aux_loss_fwd", dims({N, E, k}), kReduce,
        {in("probs", K::F32, probs), in("idx", K::I32, idx), out("f", K::F32, randn(E)), out("aux", K::F64, {1.5})},
        [=](auto& x, auto& p, DType) {
          dev::aux_loss_fwd(x, P<float>(p, 0), P<int32_t>(p, 1), P<float>(p, 2), P<double>(p, 3), N, E, k);
        });
    for (bool acc : {true, false})
      add("aux_loss_bwd", dims({N, E}) + mode(acc), kReduce,
          {in("probs", K::F32, probs), in("f", K::F32, randu(E, 0, 0.5)), out("dlogits", K::Act, randn(N * E))},
          [=](auto& x, auto& p, DType t) {
            dev::aux_loss_bwd(x, P<float>(p, 0), P<float>(p, 1), 0.01f, p[2], N, E, acc, t);
          });
    add("moe_plan", dims({N, E, k}), kElem,
        {in("idx", K::I32, idx), out("start", K::I32, randi(E + 1, 9), true),
         out("rows", K::I32, randi(N * k, 9), true), out("pos", K::I32, randi(N * k, 9), true)},
        [=](auto& x, auto& p, DType) {
          dev::moe_plan(x, P<int32_t>(p, 0), N, k, E, P<int32_t>(p, 1), P<int32_t>(p, 2), P<int32_t>(p, 3));
        });
    plan(idx, E, start, pos);
    const int64_t R = N * k, Hh = 72, Im = 40;
    add("grouped_linear_fwd", dims({R, E, Hh, Im}), kGemm,
        {in("xg", K::Act, randn(R * Hh)), in("W", K::Act, randn(E * Im * Hh, 0.1)), in("start", K::I32, start),
         out("y", K::Act, randn(R * Im))},
        [=](auto& x, auto& p, DType t) {
          dev::grouped_linear_fwd(x, p[0], p[1], P<int32_t>(p, 2), p[3], R, E, Hh, Im, t);
        });
    for (auto [acc, acc_dw] : kGroupedBwdModes)
      add("grouped_linear_bwd", dims({R, E, Hh, Im}) + mode(acc) + dw_mode(acc_dw), kGemm,
          {in("dy", K::Act, randn(R * Im)), in("xg", K::Act, randn(R * Hh)),
           in("W", K::Act, randn(E * Im * Hh, 0.1)), in("start", K::I32, start), out("dxg", K::Act, randn(R * Hh)),
           out("dW", K::F32, randn(E * Im * Hh))},
          [=](auto& x, auto& p, DType t) {
            dev::grouped_linear_bwd(x, p[0], p[1], p[2], P<int32_t>(p, 3), p[4], P<float>(p, 5), R, E, Hh, Im, acc,
                                    acc_dw, t);
          });
    for (bool plus : {false, true})
      add("moe_combine_fwd", dims({N, k, Hh}) + (plus ? " add" : ""), kReduce,
          {in("y", K::Act, randn(R * Hh)), in("pos", K::I32, pos), in("w", K::F32, randu(R, 0, 1)),
           out("out", K::Act, randn(N * Hh))},
          [=](auto& x, auto& p, DType t) {
            dev::moe_combine_fwd(x, p[0], P<int32_t>(p, 1), P<float>(p, 2), p[3], N, k, Hh, t, plus);
          });
    for (bool acc : {true, false}) {
      add("moe_combine_bwd", dims({N, k, Hh}) + mode(acc), kReduce,
          {in("dout", K::Act, randn(N * Hh)), in("y", K::Act, randn(R * Hh)), in("pos", K::I32, pos),
           in("w", K::F32, randu(R, 0, 1)), out("dw", K::F32, randn(R)), out("dy", K::Act, randn(R * Hh))},
          [=](auto& x, auto& p, DType t) {
            dev::moe_combine_bwd(x, p[0], p[1], P<int32_t>(p, 2), P<float>(p, 3), P<float>(p, 4), p[5], N, k, Hh, acc,
                                 t);
          });
      add("unpermute_add", dims({N, k, Hh}) + mode(acc), kReduce,
          {in("src", K::Act, randn(R * Hh)), in("pos", K::I32, pos), out("dst", K::Act, randn(N * Hh))},
          [=](auto& x, auto& p, DType t) { dev::unpermute_add(x, p[0], P<int32_t>(p, 1), p[2], N, k, Hh, acc, t); });
    }
  }

  // optimizer and reductions (F32 shards whatever the activation dtype)
  for (int64_t n : {1, 1000, 100003}) {
    add("adamw", dims({n}), kElem,
        {out("p", K::F32, randn(n)), in("g", K::F32, randn(n)), out("m", K::F32, randn(n, 0.1)),
         out("v", K::F32, randu(n, 0, 0.1))},
        [=](auto& x, auto& p, DType) {
          dev::adamw(x, P<float>(p, 0), P<float>(p, 1), P<float>(p, 2), P<float>(p, 3), n, 0.9, 0.95, 1e-8, 3e-4, 0.1,
                     0.5, 7);
        });
    // The update in the backward's skip (a unit's count of non-finite gradients, on the device): 0 updates, 3 leaves
    // the masters, the moments and the copy as they were (the CPU reference returns; the kernel must match it).
    for (int skip : {0, 3})
      add("adamw", dims({n}) + " skip " + std::to_string(skip), kElem,
          {out("p", K::F32, randn(n)), in("g", K::F32, randn(n)), out("m", K::F32, randn(n, 0.1)),
           out("v", K::F32, randu(n, 0, 0.1)), out("copy", K::BF16, randn(n), true),
           in("skip", K::I32, {double(skip)})},
          [=](auto& x, auto& p, DType) {
            dev::adamw(x, P<float>(p, 0), P<float>(p, 1), P<float>(p, 2), P<float>(p, 3), n, 0.9, 0.95, 1e-8, 3e-4,
                       0.1, 0.5, 7, P<uint16_t>(p, 4), DType::BF16, P<int32_t>(p, 5));
          });
    // Shards at any offset: 16-byte loads from the first element where all four arrays are aligned (offsets 1: three
    // elements ahead), one element at a time when they are aligned differently (0 1 2 3); the first elements untouched.
    if (n > 1000)
      for (const std::array<int64_t, 4> o : {std::array<int64_t, 4>{1, 1, 1, 1}, {0, 1, 2, 3}})
        add("adamw", dims({n - 3}) + " at " + dims({o[0], o[1], o[2], o[3]}), kElem,
            {out("p", K::F32, randn(n)), in("g", K::F32, randn(n)), out("m", K::F32, randn(n, 0.1)),
             out("v", K::F32, randu(n, 0, 0.1))},
            [=](auto& x, auto& p, DType) {
              dev::adamw(x, P<float>(p, 0) + o[0], P<float>(p, 1) + o[1], P<float>(p, 2) + o[2], P<float>(p, 3) + o[3],
                         n - 3, 0.9, 0.95, 1e-8, 3e-4, 0.1, 0.5, 7);
            });
    // The parameter copy in the same pass (bf16, fp16), compared exactly: convert's rounding of the same masters.
    // At offsets (the larger n): all five arrays aligned three elements on (the copy's four in one store), the copy
    // aligned differently from the masters (16-byte loads, one store an element), all arrays differently.
    using Offs = std::array<int64_t, 5>;
    const std::vector<Offs> offs = n > 1000 ? std::vector<Offs>{{0, 0, 0, 0, 0}, {1, 1, 1, 1, 1}, {1, 1, 1, 1, 0},
                                                                {0, 1, 2, 3, 1}}
                                            : std::vector<Offs>{{0, 0, 0, 0, 0}};
    for (DType ct : {DType::BF16, DType::F16})
      for (const Offs& o : offs) {
        const int64_t k = o == Offs{} ? n : n - 3;
        add("adamw", dims({k}) + " copy " + dtype_name(ct) + " at " + dims({o[0], o[1], o[2], o[3], o[4]}), kElem,
            {out("p", K::F32, randn(n)), in("g", K::F32, randn(n)), out("m", K::F32, randn(n, 0.1)),
             out("v", K::F32, randu(n, 0, 0.1)), out("copy", ct == DType::BF16 ? K::BF16 : K::F16, randn(n), true)},
            [=](auto& x, auto& p, DType) {
              dev::adamw(x, P<float>(p, 0) + o[0], P<float>(p, 1) + o[1], P<float>(p, 2) + o[2], P<float>(p, 3) + o[3],
                         k, 0.9, 0.95, 1e-8, 3e-4, 0.1, 0.5, 7, P<uint16_t>(p, 4) + o[4], ct);
            });
      }
    if (n == 1000) {  // a unit's taken slots (the update in the backward's check): in order, ids repeated and apart
      std::vector<double> nf(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) nf[size_t(i)] = double(i % 7 == 3);
      const std::vector<double> ids{5, 17, 3, 999, 0, 17, 640};
      add("sum_slots", dims({int64_t(ids.size())}) + " of " + dims({n}), kReduce,
          {in("sums", K::F64, randu(n, 0, 10)), in("bad", K::I32, nf), in("ids", K::I32, ids),
           out("acc", K::F64, {2.5}), out("nonfinite", K::I32, {1}, true)},
          [=](auto& x, auto& p, DType) {
            dev::sum_slots(x, P<double>(p, 0), P<int32_t>(p, 1), P<int32_t>(p, 2), int64_t(ids.size()), P<double>(p, 3),
                           P<int32_t>(p, 4));
          });
    }
    auto a = randn(n);
    if (n > 1) a[n / 2] = INFINITY;
    add("sum_squares", dims({n}), kReduce,
        {in("a", K::Act, a), out("acc", K::F64, {2.0}), out("nonfinite", K::I32, {1}, true)},
        [=](auto& x, auto& p, DType t) { dev::sum_squares(x, p[0], n, t, P<double>(p, 1), P<int32_t>(p, 2)); });
    // One element on (fp32: a head of three before the 16-byte loads, a tail of three after), a non-finite element
    // in each of the three parts.
    if (n > 1000) {
      auto b = randn(n);
      b[2] = INFINITY, b[n / 2] = NAN, b[n - 2] = -INFINITY;
      add("sum_squares", dims({n - 1}) + " at 1", kReduce,
          {in("a", K::Act, b), out("acc", K::F64, {2.0}), out("nonfinite", K::I32, {1}, true)},
          [=](auto& x, auto& p, DType t) {
            dev::sum_squares(x, static_cast<char*>(p[0]) + dtype_size(t), n - 1, t, P<double>(p, 1), P<int32_t>(p, 2));
          });
    }
  }
  return cs;
}

// Q3VL_OPS=a,b (device calls that check a few ops): only the cases whose op name contains one of the comma-separated
// parts run; the table says how many it left out.
bool selected(const std::string& op) {
  const char* env = std::getenv("Q3VL_OPS");
  if (!env || !*env) return true;
  std::string parts = env;
  for (size_t a = 0, b; a <= parts.size(); a = b + 1) {
    b = std::min(parts.find(',', a), parts.size());
    if (b > a && op.find(parts.substr(a, b - a)) != std::string::npos) return true;
  }
  return false;
}

// Runs every case at dtype dt on the GPU against the CPU; one printed line per case.
void run_table(DType dt) {
  dev::Exec ref = dev::make_exec(Device::CPU), dut = dev::make_exec(Device::CUDA);
  int failed = 0, n = 0, left_out = 0;
  for (Case& c : all_cases(dt)) {
    if (!selected(c.op)) {
      ++left_out;
      continue;
    }
    // Inputs are rounded to the case's dtype first, so both sides see identical values.
    for (Arg& a : c.args) a.v = decode(encode(a.v, dtype_of(a.kind, dt)), dtype_of(a.kind, dt));
    const auto want = execute(c, ref, DType::F32);
    const auto got = execute(c, dut, dt);
    double worst = 0;
    std::string what;
    for (size_t i = 0; i < c.args.size(); ++i) {
      if (!c.args[i].out) continue;
      // Not compare.hpp's helpers: an Inf the reference has too is the right answer here (sum_squares' nonfinite
      // case); NaN on either side, or an Inf the other lacks, is +inf (and an Inf reference no scale: inf/inf is NaN).
      double maxref = 0, maxdiff = 0;
      for (size_t j = 0; j < want[i].size(); ++j) {
        const double d = std::isinf(want[i][j]) && want[i][j] == got[i][j] ? 0 : std::abs(got[i][j] - want[i][j]);
        maxdiff = std::max(maxdiff, std::isnan(d) ? INFINITY : d);
        if (std::isfinite(want[i][j])) maxref = std::max(maxref, std::abs(want[i][j]));
      }
      const double err = maxdiff == INFINITY || (c.args[i].exact && maxdiff > 0) ? INFINITY
                         : c.args[i].exact                                       ? 0
                                                                                 : maxdiff / std::max(maxref, 1e-30);
      if (err >= worst) worst = err, what = c.args[i].name;
    }
    const bool ok = worst <= c.tol;
    failed += !ok;
    ++n;
    std::printf("  %-19s %-36s %-4s %-4s err %.2e (%s) tol %.0e  %s\n", c.op.c_str(), c.shape.c_str(),
                dtype_name(dt), "cuda", worst, what.c_str(), c.tol,
                ok ? "ok" : "FAIL");
    EXPECT_TRUE(ok) << c.op << " " << c.shape << " " << dtype_name(dt) << ": normalised error " << worst << " in "
                    << what << " above " << c.tol;
  }
  std::printf("  %d of %d cases within bounds\n", n - failed, n);
  if (left_out) std::printf("  %d cases left out by Q3VL_OPS=%s\n", left_out, std::getenv("Q3VL_OPS"));
  dev::destroy_exec(dut);
}

}  // namespace

TEST(BackendOps, Fp32) {
  Q3VL_NEED_GPU();
  run_table(DType::F32);
}
// The paged reference pinned to the packed one: with each segment a whole fresh prompt (ctx = n) stored contiguously
// in the pool (blocks in order, the rest of the pool random), paged_attention_fwd is ops::attention_fwd (causal).
TEST(BackendOps, PagedAttentionMatchesAttention) {
  const std::vector<int64_t> lens{1, 37, 64, 130};
  const int64_t N = 232, nseg = 4;
  for (int64_t hd : {16, 64, 72})
    for (auto [nh, nkv] : {std::pair<int64_t, int64_t>{4, 2}, {2, 2}, {8, 1}})
      for (int64_t block : {16, 32}) {
        const float sc = float(1 / std::sqrt(double(hd)));
        auto rf = [](int64_t n) {
          auto d = randn(n);
          return std::vector<float>(d.begin(), d.end());
        };
        std::vector<float> q = rf(N * nh * hd), k = rf(N * nkv * hd), v = rf(N * nkv * hd), want(N * nh * hd),
                           lse(N * nh), got(N * nh * hd, NAN);
        std::vector<int64_t> cu64{0};
        std::vector<int32_t> cu{0}, ctx, table;
        int64_t max_blocks = 0, blocks = 0;
        for (int64_t l : lens) max_blocks = std::max(max_blocks, (l + block - 1) / block);
        std::vector<int64_t> base;
        for (int64_t l : lens) {
          cu64.push_back(cu64.back() + l);
          cu.push_back(int32_t(cu64.back()));
          ctx.push_back(int32_t(l));
          base.push_back(blocks);
          const int64_t nb = (l + block - 1) / block;
          for (int64_t j = 0; j < max_blocks; ++j) table.push_back(int32_t(j < nb ? blocks + j : 0));
          blocks += nb;
        }
        const int64_t row = nkv * hd;
        std::vector<float> kp = rf((blocks + 2) * block * row), vp = rf((blocks + 2) * block * row);
        for (int64_t s = 0; s < nseg; ++s)
          for (int64_t j = 0; j < lens[s]; ++j) {
            std::copy_n(&k[(cu64[s] + j) * row], row, &kp[(base[s] * block + j) * row]);
            std::copy_n(&v[(cu64[s] + j) * row], row, &vp[(base[s] * block + j) * row]);
          }
        ops::attention_fwd(q.data(), k.data(), v.data(), want.data(), lse.data(), cu64.data(), nseg, nh, nkv, hd, true,
                           sc);
        dev::paged_attention_fwd(dev::Exec{}, q.data(), kp.data(), vp.data(), got.data(), cu.data(), ctx.data(),
                                 table.data(), max_blocks, block, nseg, 130, 130, 0, N, nh, nkv, hd, sc, DType::F32);
        const double err = test::rel_max_diff(got, want);  // NaN or Inf: +inf
        std::printf("  paged vs packed attention %s b%lld: err %.2e\n", dims({nh, nkv, hd}).c_str(), (long long)block,
                    err);
        EXPECT_LE(err, 1e-5) << dims({nh, nkv, hd}) << " block " << block;
      }
}
// The batched linears' reference is linear_fwd / linear_bwd on each problem in turn, bit for bit (a shared operand's
// gradient: the problems' sum, a shared din written by the first when not accumulating); without a gradient (null)
// too. What the vision tower's CPU results rest on.
TEST(BackendOps, BatchedLinearIsItsProblems) {
  const dev::Exec cpu{};
  auto rf = [](int64_t n) {
    auto d = randn(n);
    return std::vector<float>(d.begin(), d.end());
  };
  for (const BatchedShape& sh : batched_shapes(false)) {
    const int64_t N = sh.N, I = sh.I, O = sh.O, n = sh.bt.count;
    const dev::LinearBatch bt = sh.bt;
    const std::string d = dims({N, I, O}) + " x" + std::to_string(n) + sh.what;
    const std::vector<float> x = rf(span(n, bt.in, N * I)), W = rf(span(n, bt.W, O * I)), b = rf(span(n, bt.b, O)),
                             dy = rf(span(n, bt.y, N * O)), y0 = rf(span(n, bt.y, N * O));
    for (bool bias : {false, true}) {
      std::vector<float> want = y0, got = y0;
      for (int64_t j = 0; j < n; ++j)
        dev::linear_fwd(cpu, &x[j * bt.in], &W[j * bt.W], bias ? &b[j * bt.b] : nullptr, &want[j * bt.y], N, I, O,
                        DType::F32);
      dev::linear_fwd_batched(cpu, x.data(), W.data(), bias ? b.data() : nullptr, got.data(), N, I, O, bt, DType::F32);
      EXPECT_EQ(got, want) << d << (bias ? " bias" : "");
    }
    for (auto [acc, acc_w] : {std::pair{true, true}, {false, true}, {false, false}})
      for (bool grads : {true, false}) {
        const std::string m = mode(acc) + (acc_w ? "" : " dW=") + (grads ? "" : " frozen");
        const std::vector<float> dx0 = rf(span(n, bt.in, N * I)), dW0 = rf(span(n, bt.W, O * I)),
                                 db0 = rf(span(n, bt.b, O));
        std::vector<float> dx = dx0, dW = dW0, db = db0, gx = dx0, gW = dW0, gb = db0;
        for (int64_t j = 0; j < n; ++j) {  // dW and db apart: each shared (added to after problem 0) or not
          dev::linear_bwd(cpu, &dy[j * bt.y], &x[j * bt.in], &W[j * bt.W], &dx[j * bt.in],
                          grads ? &dW[j * bt.W] : nullptr, nullptr, N, I, O, acc || (j > 0 && bt.in == 0),
                          acc_w || (j > 0 && bt.W == 0), DType::F32);
          if (grads)
            dev::linear_bwd(cpu, &dy[j * bt.y], &x[j * bt.in], &W[j * bt.W], nullptr, nullptr, &db[j * bt.b], N, I,
                            O, true, acc_w || (j > 0 && bt.b == 0), DType::F32);
        }
        dev::linear_bwd_batched(cpu, dy.data(), x.data(), W.data(), gx.data(), grads ? gW.data() : nullptr,
                                grads ? gb.data() : nullptr, N, I, O, bt, acc, acc_w, DType::F32);
        EXPECT_EQ(gx, dx) << d << m;
        EXPECT_EQ(gW, dW) << d << m;
        EXPECT_EQ(gb, db) << d << m;
      }
  }
  // Written operands whose strides overlap the problems are refused.
  std::vector<float> buf(4096);
  EXPECT_ANY_THROW(dev::linear_fwd_batched(cpu, buf.data(), buf.data(), nullptr, buf.data(), 4, 8, 8,
                                           {2, 0, 64, 0, 31}, DType::F32));
  EXPECT_ANY_THROW(dev::linear_bwd_batched(cpu, buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), nullptr, 4,
                                           8, 8, {2, 16, 64, 0, 32}, false, true, DType::F32));
}
// The 8-bit experts' reference is grouped_linear_fwd on the dequantized weights (q * scale), up to rounding: the
// reference scales the fp32 sums, the dequantized product scales each weight. int8 and fp8 alike.
void grouped_q8_is_dequantized_grouped(QFormat qf) {
  const int64_t E = 6, I = 40, O = 24, R = 23;
  std::vector<double> ex = randi(R, E - 1);  // the last expert has no rows
  ex[0] = ex[1] = 0;
  std::sort(ex.begin(), ex.end());
  const std::vector<double> sd = starts_of(ex, E);
  const std::vector<int32_t> start(sd.begin(), sd.end());
  std::vector<uint8_t> q;
  std::vector<float> sc;
  q8_weights(qf, E * O, I, q, sc);
  std::vector<float> w(q.size());
  for (size_t i = 0; i < q.size(); ++i) w[i] = q8_weight(qf, q, sc, i, I);
  const auto xd = randn(R * I);
  const std::vector<float> x(xd.begin(), xd.end());
  std::vector<float> want(size_t(R * O), NAN), got(size_t(R * O), NAN);
  dev::grouped_linear_fwd(dev::Exec{}, x.data(), w.data(), start.data(), want.data(), R, E, I, O, DType::F32);
  dev::grouped_linear_q8_fwd(dev::Exec{}, x.data(), q.data(), sc.data(), start.data(), got.data(), R, E, I, O, qf,
                             DType::F32);
  EXPECT_GT(test::max_abs(want), 0.0);
  EXPECT_LE(test::rel_max_diff(got, want), 1e-6) << qformat_name(qf);  // NaN or Inf: +inf
}
// The table's moe_route inputs hold what route_inputs says, on the CPU: the same values in every dtype, fp32 logits
// equal to the exact sums, and row 0's picks the k lowest of the k + 1 tied leads (in index order, equal weights).
TEST(BackendOps, RouteInputsAreExact) {
  for (auto [N, H, E, k] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{64, 2048, 128, 8}, {9, 72, 16, 4}}) {
    std::vector<double> xv, wv;
    route_inputs(N, H, E, k, xv, wv);
    for (DType t : {DType::BF16, DType::F16})
      EXPECT_TRUE(decode(encode(xv, t), t) == xv && decode(encode(wv, t), t) == wv) << dtype_name(t);
    const std::vector<float> x(xv.begin(), xv.end()), W(wv.begin(), wv.end());
    std::vector<float> logits(N * E), probs(N * E), w(N * k);
    std::vector<int32_t> idx(N * k), start(E + 1), rows(N * k), pos(N * k);
    dev::moe_route(dev::Exec{}, x.data(), W.data(), logits.data(), probs.data(), idx.data(), w.data(), start.data(),
                   rows.data(), pos.data(), N, H, E, k, DType::F32);
    int64_t inexact = 0;  // logits not equal to the exact sum (a NaN counts)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        long double z = 0;
        for (int64_t c = 0; c < H; ++c) z += (long double)xv[n * H + c] * wv[e * H + c];
        inexact += !(z == (long double)logits[n * E + e]);
      }
    EXPECT_EQ(inexact, 0) << dims({N, H, E, k});
    std::vector<int32_t> lead;  // route_inputs' k + 1 tied leads, in index order
    for (int64_t i = 0; i <= k; ++i) lead.push_back(int32_t((3 + 7 * i) % E));
    std::sort(lead.begin(), lead.end());
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(idx[j], lead[j]) << dims({N, H, E, k}) << " pick " << j;
      EXPECT_FLOAT_EQ(w[j], 1.f / float(k));
    }
  }
}
// The fused QK-norm and rotary backward's reference is rope_bwd on dq and dk, then rmsnorm_bwd over their head rows,
// bit for bit: dqr/dkr written or accumulated, dwq/dwk accumulated, dq/dk left rotated as the two ops leave them.
TEST(BackendOps, QkNormRopeBwdIsRopeThenRmsnorm) {
  const dev::Exec cpu{};
  auto rf = [](int64_t n, double lo = 0, double hi = 0) {
    auto d = hi > lo ? randu(n, lo, hi) : randn(n);
    return std::vector<float>(d.begin(), d.end());
  };
  const int64_t nh = 16, nkv = 8;
  for (int64_t hd : {128, 64, 72})
    for (int64_t N : {1, 9, 23})
      for (bool acc : {false, true}) {
        const int64_t nq = N * nh * hd, nk = N * nkv * hd;
        const Rotary r = rotary(N, hd);
        const std::vector<float> cos(r.cos.begin(), r.cos.end()), sin(r.sin.begin(), r.sin.end());
        const std::vector<float> qraw = rf(nq), kraw = rf(nk), wq = rf(hd, 0.5, 1.5), wk = rf(hd, 0.5, 1.5),
                                 rq = rf(N * nh, 0.5, 2), rk = rf(N * nkv, 0.5, 2);
        std::vector<float> dq = rf(nq), dk = rf(nk), dqr = rf(nq), dkr = rf(nk), dwq = rf(hd), dwk = rf(hd);
        std::vector<float> gq = dq, gk = dk, gqr = dqr, gkr = dkr, gwq = dwq, gwk = dwk;
        const std::vector<float> dq0 = dq, dk0 = dk, dqr0 = dqr, dkr0 = dkr, dwq0 = dwq, dwk0 = dwk;
        dev::rope_bwd(cpu, dq.data(), cos.data(), sin.data(), N, nh, hd, DType::F32);
        dev::rope_bwd(cpu, dk.data(), cos.data(), sin.data(), N, nkv, hd, DType::F32);
        dev::rmsnorm_bwd(cpu, dq.data(), qraw.data(), wq.data(), rq.data(), dqr.data(), dwq.data(), N * nh, hd, acc,
                         DType::F32);
        dev::rmsnorm_bwd(cpu, dk.data(), kraw.data(), wk.data(), rk.data(), dkr.data(), dwk.data(), N * nkv, hd, acc,
                         DType::F32);
        dev::qk_norm_rope_bwd(cpu, gq.data(), gk.data(), qraw.data(), kraw.data(), wq.data(), wk.data(), rq.data(),
                              rk.data(), cos.data(), sin.data(), gqr.data(), gkr.data(), gwq.data(), gwk.data(), N, nh,
                              nkv, hd, 0, acc, DType::F32);
        const std::string d = dims({N, nh, nkv, hd}) + mode(acc);
        EXPECT_EQ(gqr, dqr) << d;
        EXPECT_EQ(gkr, dkr) << d;
        EXPECT_EQ(gwq, dwq) << d;
        EXPECT_EQ(gwk, dwk) << d;
        EXPECT_EQ(gq, dq) << d;
        EXPECT_EQ(gk, dk) << d;
        // Training's fused rows q | k | v (ld = (nh + 2 nkv) hd): the same values in q's and k's columns, v's untouched.
        const int64_t Dq = nh * hd, Dk = nkv * hd, ld = Dq + 2 * Dk;
        std::vector<float> raw = rf(N * ld), draw = rf(N * ld);
        const std::vector<float> vcols = draw;
        for (int64_t i = 0; i < N; ++i) {
          std::copy_n(&qraw[i * Dq], Dq, &raw[i * ld]), std::copy_n(&kraw[i * Dk], Dk, &raw[i * ld + Dq]);
          std::copy_n(&dqr0[i * Dq], Dq, &draw[i * ld]), std::copy_n(&dkr0[i * Dk], Dk, &draw[i * ld + Dq]);
        }
        std::vector<float> fq = dq0, fk = dk0, fwq = dwq0, fwk = dwk0;
        dev::qk_norm_rope_bwd(cpu, fq.data(), fk.data(), raw.data(), raw.data() + Dq, wq.data(), wk.data(), rq.data(),
                              rk.data(), cos.data(), sin.data(), draw.data(), draw.data() + Dq, fwq.data(), fwk.data(),
                              N, nh, nkv, hd, ld, acc, DType::F32);
        for (int64_t i = 0; i < N; ++i) {
          ASSERT_TRUE(std::equal(&draw[i * ld], &draw[i * ld + Dq], &dqr[i * Dq])) << d << " fused, row " << i;
          ASSERT_TRUE(std::equal(&draw[i * ld + Dq], &draw[i * ld + Dq + Dk], &dkr[i * Dk])) << d << " fused, row " << i;
          ASSERT_TRUE(std::equal(&draw[i * ld + Dq + Dk], &draw[(i + 1) * ld], &vcols[i * ld + Dq + Dk])) << d;
        }
        EXPECT_EQ(fwq, dwq) << d << " fused";
        EXPECT_EQ(fwk, dwk) << d << " fused";
      }
}
TEST(BackendOps, GroupedInt8IsDequantizedGrouped) { grouped_q8_is_dequantized_grouped(QFormat::Int8); }
TEST(BackendOps, GroupedFp8IsDequantizedGrouped) { grouped_q8_is_dequantized_grouped(QFormat::Fp8); }
TEST(BackendOps, Bf16) {
  Q3VL_NEED_GPU();
  run_table(DType::BF16);
}
TEST(BackendOps, Fp16) {
  Q3VL_NEED_GPU();
  run_table(DType::F16);
}
