#include "q3vl/serve/tp.hpp"

#include <algorithm>
#include <string>

#include "q3vl/core/error.hpp"

namespace q3vl {

namespace {
struct Split {
  int64_t q0, nq, kv0, nkv, i0, ni;  // query heads, kv heads, intermediate rows of this rank
};
Split split(const TextConfig& t, int rank, int size) {
  const std::string tp = "serve.tp = " + std::to_string(size);
  if (t.num_experts > 0) fail(tp + ": tensor parallelism of MoE layers is not supported yet; use serve.tp = 1");
  if (t.heads % size) fail(tp + " does not divide the " + std::to_string(t.heads) + " attention heads");
  if (t.intermediate % size) fail(tp + " does not divide the MLP's " + std::to_string(t.intermediate) + " rows");
  if (size <= t.kv_heads ? t.kv_heads % size : size % t.kv_heads)
    fail(tp + " and the " + std::to_string(t.kv_heads) + " key/value heads: one must divide the other");
  Split s;
  s.nq = t.heads / size, s.q0 = rank * s.nq;
  s.nkv = std::max(1, t.kv_heads / size);
  s.kv0 = size <= t.kv_heads ? rank * s.nkv : s.q0 / (t.heads / t.kv_heads);  // replicated: the group of its queries
  s.ni = t.intermediate / size, s.i0 = rank * s.ni;
  return s;
}
}  // namespace

ModelConfig tp_config(const ModelConfig& full, int rank, int size) {
  const Split s = split(full.text, rank, size);
  ModelConfig c = full;
  c.text.heads = (int)s.nq;
  c.text.kv_heads = (int)s.nkv;
  c.text.intermediate = (int)s.ni;
  return c;
}

std::pair<int64_t, int64_t> tp_vocab_rows(int64_t vocab, int rank, int size) {
  const int64_t per = (vocab + size - 1) / size;
  return {std::min(vocab, rank * per), std::min(vocab, (rank + 1) * per)};
}

void tp_shard_weights(Model& full, Model& local, int rank, int size) {
  const TextConfig& t = full.config().text;
  const Split s = split(t, rank, size);
  const int64_t hd = t.head_dim;
  for (int l = 0; l < t.layers; ++l) {
    const int f = full.table().layer(l);
    if (local.table().layer(l) != f) fail("tp: the local parameter table differs from the full one");
  }
  for (size_t id = 0; id < full.table().params().size(); ++id) {
    const ParamInfo& pf = full.table().params()[id];
    const ParamInfo& pl = local.table().params()[id];
    const float* src = full.param((int)id);
    float* dst = local.param((int)id);
    if (pf.shape == pl.shape) {
      std::copy(src, src + pf.numel, dst);
      continue;
    }
    // Which decoder tensor: its offset from its layer's first id.
    int which = -1;
    for (int l = 0; l < t.layers && which < 0; ++l)
      if ((int)id >= full.table().layer(l) && (int)id < full.table().layer(l) + tlay::count)
        which = (int)id - full.table().layer(l);
    const int64_t rows = pf.shape[0], cols = pf.shape[1];
    auto take_rows = [&](int64_t r0, int64_t n) { std::copy(src + r0 * cols, src + (r0 + n) * cols, dst); };
    auto take_cols = [&](int64_t c0, int64_t n) {
      for (int64_t r = 0; r < rows; ++r) std::copy(src + r * cols + c0, src + r * cols + c0 + n, dst + r * n);
    };
    switch (which) {
      case tlay::q_proj: take_rows(s.q0 * hd, s.nq * hd); break;
      case tlay::k_proj:
      case tlay::v_proj: take_rows(s.kv0 * hd, s.nkv * hd); break;
      case tlay::o_proj: take_cols(s.q0 * hd, s.nq * hd); break;
      case tlay::gate_proj:
      case tlay::up_proj: take_rows(s.i0, s.ni); break;
      case tlay::down_proj: take_cols(s.i0, s.ni); break;
      default: fail("tp: no rule to split " + pf.name);
    }
  }
}

}  // namespace q3vl
