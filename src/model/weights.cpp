// HF safetensors <-> model, through the parameter table. Only MoE expert tensors differ between the file and our
// compute layout (transformers-5 module layout): the released files store them transposed per expert (spec 8.3).
#include <algorithm>
#include <atomic>
#include <thread>
#include <cmath>

#include "q3vl/core/error.hpp"
#include "q3vl/core/hash.hpp"
#include "q3vl/core/parallel.hpp"
#include "q3vl/model/lora.hpp"  // peft_name
#include "q3vl/model/weights.hpp"
#include "q3vl/tensor/tensor.hpp"  // shape_str

namespace q3vl {

static bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

static bool is_expert(const std::string& name) {
  return ends_with(name, "mlp.experts.gate_up_proj") || ends_with(name, "mlp.experts.down_proj");
}

bool hf_expert(const ParamTable& t, int id) { return is_expert(t.param(id).name); }

std::vector<int64_t> hf_shape(const ParamTable& t, int id) {
  const ParamInfo& p = t.param(id);
  if (is_expert(p.name) && !t.config().experts_v5_layout) return {p.shape[0], p.shape[2], p.shape[1]};
  return p.shape;
}

// Swap the last two dims of [E, a, b] -> [E, b, a].
static std::vector<float> transpose12(const float* x, int64_t E, int64_t a, int64_t b) {
  std::vector<float> y(E * a * b);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < a; ++i)
      for (int64_t j = 0; j < b; ++j) y[(e * b + j) * a + i] = x[(e * a + i) * b + j];
  return y;
}

std::vector<float> from_hf_layout(const ParamTable& t, int id, std::vector<float> v) {
  const ParamInfo& p = t.param(id);
  if (!is_expert(p.name) || t.config().experts_v5_layout) return v;
  const auto d = hf_shape(t, id);
  return transpose12(v.data(), d[0], d[1], d[2]);
}

std::vector<float> to_hf_layout(const ParamTable& t, int id, const float* data) {
  const ParamInfo& p = t.param(id);
  if (is_expert(p.name) && !t.config().experts_v5_layout) return transpose12(data, p.shape[0], p.shape[1], p.shape[2]);
  return std::vector<float>(data, data + p.numel);
}

std::vector<NamedTensor> grads_hf(const HostWeights& w) {
  std::vector<NamedTensor> out;
  const ParamTable& t = w.table();
  const bool lora = t.config().lora.on();
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.params()[id];
    if (lora && p.part != Part::Lora) continue;  // a frozen base has no gradients; adapters go under PEFT's names
    out.push_back({lora ? peft_name(p.name) : p.name, hf_shape(t, (int)id), to_hf_layout(t, (int)id, w.grad((int)id))});
  }
  return out;
}

HostWeights::HostWeights(const ModelConfig& cfg, bool with_grads, ExpertSplit ep)
    : table_(cfg, ep), p_(size_t(table_.total()), 0.f), g_(with_grads ? size_t(table_.total()) : 0, 0.f) {}

int64_t HostWeights::at(int id) const {
  const ParamInfo& p = table_.param(id);
  return table_.units()[size_t(p.unit)].offset + p.offset;
}

void HostWeights::init_random(uint64_t seed, double std) {
  for (size_t i = 0; i < table_.params().size(); ++i) {
    const ParamInfo& p = table_.params()[i];
    init_param_range(p, seed, std, p.held_begin, p.held, param(int(i)));
  }
}

static bool is_bias(const std::string& name) { return ends_with(name, ".bias"); }

template <class T>
void init_param_range(const ParamInfo& p, uint64_t seed, double std, int64_t begin, int64_t count, T* out) {
  if (p.no_decay) return (void)std::fill(out, out + count, T(is_bias(p.name) ? 0 : 1));
  uint64_t key = splitmix64(seed);
  for (unsigned char c : p.name) key = splitmix64(key ^ c);
  if (p.part == Part::Lora) {
    // PEFT: B = 0; A = kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)) (gain sqrt(1/3) * sqrt(3/in)).
    if (ends_with(p.name, ".lora_B.weight")) return (void)std::fill(out, out + count, T(0));
    const double bound = 1.0 / std::sqrt(double(p.shape[1]));
    for (int64_t j = 0; j < count; ++j)
      out[j] = T(bound * (2.0 * (double(splitmix64(key ^ splitmix64(uint64_t(begin + j))) >> 11) * 0x1p-53) - 1.0));
    return;
  }
  // Box-Muller on counter k gives elements 2k (cosine) and 2k+1 (sine); u1 in (0, 1] keeps the log finite.
  const int64_t end = begin + count;
  for (int64_t k = begin / 2; 2 * k < end; ++k) {
    const uint64_t c = 2 * uint64_t(k);
    const double u1 = (double(splitmix64(key ^ splitmix64(c)) >> 11) + 1.0) * 0x1p-53;
    const double u2 = double(splitmix64(key ^ splitmix64(c + 1)) >> 11) * 0x1p-53;
    const double r = std * std::sqrt(-2.0 * std::log(u1)), a = 6.283185307179586 * u2;
    if (2 * k >= begin) out[2 * k - begin] = T(r * std::cos(a));
    if (2 * k + 1 >= begin && 2 * k + 1 < end) out[2 * k + 1 - begin] = T(r * std::sin(a));
  }
}
template void init_param_range(const ParamInfo&, uint64_t, double, int64_t, int64_t, float*);
template void init_param_range(const ParamInfo&, uint64_t, double, int64_t, int64_t, double*);

SliceBytes init_random_slices(const ParamTable& t, uint64_t seed, double std, const std::vector<ParamSlice>& slices) {
  SliceBytes b;
  b.all = t.total() * int64_t(sizeof(float));
  // Every value is a pure function of its index, so chunks can be drawn on all cores (a 2B model is ~1e9 draws).
  std::vector<ParamSlice> chunks;
  constexpr int64_t kChunk = int64_t(1) << 20;
  for (const ParamSlice& s : slices) {
    b.mine += s.count * int64_t(sizeof(float));
    for (int64_t o = 0; o < s.count; o += kChunk)
      chunks.push_back({s.param, s.begin + o, std::min(kChunk, s.count - o), s.dst + o});
  }
  parallel_for(int64_t(chunks.size()), [&](int64_t i) {
    const ParamSlice& c = chunks[size_t(i)];
    init_param_range(t.param(c.param), seed, std, c.begin, c.count, c.dst);
  });
  return b;
}

}  // namespace q3vl
