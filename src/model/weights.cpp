// HF safetensors <-> model, through the parameter table. Only MoE expert tensors differ between the file and our
// compute layout (transformers-5 module layout): the released files store them transposed per expert (spec 8.3).
#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/io/safetensors.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/tensor/tensor.hpp"  // shape_str

namespace q3vl {

static bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

static bool is_expert(const std::string& name) {
  return ends_with(name, "mlp.experts.gate_up_proj") || ends_with(name, "mlp.experts.down_proj");
}

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

std::vector<float> to_hf_layout(const ParamTable& t, int id, const float* data) {
  const ParamInfo& p = t.param(id);
  if (is_expert(p.name) && !t.config().experts_v5_layout) return transpose12(data, p.shape[0], p.shape[1], p.shape[2]);
  return std::vector<float>(data, data + p.numel);
}

std::vector<NamedTensor> grads_hf(Model& m) {
  std::vector<NamedTensor> out;
  for (size_t id = 0; id < m.table().params().size(); ++id)
    out.push_back({m.table().params()[id].name, hf_shape(m.table(), (int)id),
                   to_hf_layout(m.table(), (int)id, m.grad((int)id))});
  return out;
}

void load_hf_weights(Model& m, const std::string& dir) {
  const ParamTable& t = m.table();
  const Safetensors st = Safetensors::open(dir);
  const bool v5 = t.config().experts_v5_layout;
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.params()[id];
    const auto want = hf_shape(t, (int)id);
    if (!st.has(p.name))
      fail(dir + ": missing tensor " + p.name + " (expected shape " + shape_str(want) + ")");
    const auto& have = st.info(p.name).shape;
    if (have != want)
      fail(dir + ": tensor " + p.name + " has shape " + shape_str(have) + ", the config needs " + shape_str(want) +
           (is_expert(p.name) ? std::string(" (expert layout: ") + (v5 ? "transformers-5 module" : "released") +
                                    ", chosen by transformers_version in config.json)"
                              : std::string()));
    std::vector<float> v = st.read_f32(p.name);
    if ((int64_t)v.size() != p.numel) fail(dir + ": tensor " + p.name + " read " + std::to_string(v.size()) + " values");
    if (is_expert(p.name) && !v5) v = transpose12(v.data(), want[0], want[1], want[2]);  // disk -> compute
    std::copy(v.begin(), v.end(), m.param((int)id));
  }
  for (const auto& [name, info] : st.tensors())
    if (t.find(name) < 0)
      fail(dir + ": unexpected tensor " + name + " " + shape_str(info.shape) +
           (name == "lm_head.weight" ? " (config.json ties the word embeddings)" : ""));
}

}  // namespace q3vl
