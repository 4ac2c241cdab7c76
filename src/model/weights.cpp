// HF safetensors <-> model, through the parameter table. Only MoE expert tensors differ between the file and our
// compute layout (transformers-5 module layout): the released files store them transposed per expert (spec 8.3).
#include <algorithm>
#include <atomic>
#include <thread>
#include <cmath>

#include "q3vl/core/error.hpp"
#include "q3vl/core/hash.hpp"
#include "q3vl/core/parallel.hpp"
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
  const bool lora = m.config().lora.on();
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    if (lora && p.part != Part::Lora) continue;  // a frozen base has no gradients; adapters go under PEFT's names
    out.push_back({lora ? peft_name(p.name) : p.name, hf_shape(m.table(), (int)id),
                   to_hf_layout(m.table(), (int)id, m.grad((int)id))});
  }
  return out;
}

SliceBytes load_lora_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices) {
  const std::string file = dir + "/adapter_model.safetensors";
  const Safetensors st = Safetensors::open(file);
  SliceBytes b;
  for (const ParamInfo& p : t.params()) {
    if (p.part != Part::Lora) continue;
    const std::string n = peft_name(p.name);
    if (!st.has(n))
      fail(file + ": missing tensor " + n + " " + shape_str(p.shape) + " (lora.targets wraps " +
           p.name.substr(0, p.name.rfind(".lora_")) + "; the adapter does not)");
    if (st.info(n).shape != p.shape)
      fail(file + ": tensor " + n + " has shape " + shape_str(st.info(n).shape) + ", lora.rank and the model need " +
           shape_str(p.shape));
    b.all += int64_t(st.info(n).nbytes);
  }
  for (const auto& [name, info] : st.tensors()) {
    const std::string prefix = "base_model.model.";
    const int id = name.rfind(prefix, 0) == 0 ? t.find(name.substr(prefix.size())) : -1;
    if (id < 0 || t.param(id).part != Part::Lora)
      fail(file + ": unexpected tensor " + name + " (not an adapter of this model under lora.targets)");
  }
  for (const ParamSlice& s : slices) {
    if (s.count == 0) continue;
    const ParamInfo& p = t.param(s.param);
    if (p.part != Part::Lora) fail("load_lora_slices: " + p.name + " is not an adapter");
    st.read_f32_range(peft_name(p.name), s.begin, s.count, s.dst);
    b.mine += s.count * int64_t(st_dtype_size(st.info(peft_name(p.name)).dtype));
  }
  return b;
}

void load_lora_adapter(Model& m, const std::string& dir) {
  std::vector<ParamSlice> all;
  for (size_t id = 0; id < m.table().params().size(); ++id)
    if (m.table().params()[id].part == Part::Lora)
      all.push_back({int(id), 0, m.table().params()[id].numel, m.param(int(id))});
  load_lora_slices(m.table(), dir, all);
}

// Every table tensor present with its on-disk shape, and nothing else in the files.
static void check_hf_tensors(const ParamTable& t, const Safetensors& st, const std::string& dir) {
  const bool v5 = t.config().experts_v5_layout;
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.params()[id];
    if (p.part == Part::Lora) continue;  // adapters live in a PEFT folder (lora.adapter), not in the base model
    const auto want = hf_shape(t, (int)id);
    if (!st.has(p.name))
      fail(dir + ": missing tensor " + p.name + " (expected shape " + shape_str(want) + ")");
    const auto& have = st.info(p.name).shape;
    if (have != want)
      fail(dir + ": tensor " + p.name + " has shape " + shape_str(have) + ", the config needs " + shape_str(want) +
           (is_expert(p.name) ? std::string(" (expert layout: ") + (v5 ? "transformers-5 module" : "released") +
                                    ", chosen by transformers_version in config.json)"
                              : std::string()));
  }
  for (const auto& [name, info] : st.tensors())
    if (t.find(name) < 0)
      fail(dir + ": unexpected tensor " + name + " " + shape_str(info.shape) +
           (name == "lm_head.weight" ? " (config.json ties the word embeddings)" : ""));
}

// Whole tensors, converted with transpose12: the reference the sliced reads below are tested against.
void load_hf_weights(Model& m, const std::string& dir) {
  const ParamTable& t = m.table();
  const Safetensors st = Safetensors::open(dir);
  check_hf_tensors(t, st, dir);
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.params()[id];
    if (p.part == Part::Lora) {  // PEFT's fresh adapter (B = 0: the base model's output); lora.adapter replaces it
      init_param_range(p, 0, 0.0, 0, p.numel, m.param((int)id));
      continue;
    }
    std::vector<float> v = st.read_f32(p.name);
    if (is_expert(p.name) && !t.config().experts_v5_layout) {  // disk -> compute
      const auto d = hf_shape(t, (int)id);
      v = transpose12(v.data(), d[0], d[1], d[2]);
    }
    std::copy(v.begin(), v.end(), m.param((int)id));
  }
}

SliceBytes load_hf_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices) {
  const Safetensors st = Safetensors::open(dir);
  check_hf_tensors(t, st, dir);
  SliceBytes b;
  for (const ParamInfo& p : t.params())
    if (p.part != Part::Lora) b.all += int64_t(st.info(p.name).nbytes);
  for (const ParamSlice& s : slices) {
    if (s.count == 0) continue;
    const ParamInfo& p = t.param(s.param);
    if (p.part == Part::Lora) fail("load_hf_slices: " + p.name + " is an adapter (load it with load_lora_slices)");
    const int64_t es = int64_t(st_dtype_size(st.info(p.name).dtype));
    if (!is_expert(p.name) || t.config().experts_v5_layout) {  // same layout on disk
      st.read_f32_range(p.name, s.begin, s.count, s.dst);
      b.mine += s.count * es;
      continue;
    }
    // Compute layout [E, a, b], disk [E, b, a]: read each expert the slice touches, take its part transposed.
    const int64_t a = p.shape[1], bb = p.shape[2], n = a * bb;
    std::vector<float> blk(size_t(n), 0.f);
    for (int64_t e = s.begin / n; e <= (s.begin + s.count - 1) / n; ++e) {
      st.read_f32_range(p.name, e * n, n, blk.data());
      b.mine += n * es;
      const int64_t lo = std::max(s.begin, e * n), hi = std::min(s.begin + s.count, (e + 1) * n);
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t i = (k - e * n) / bb, j = (k - e * n) % bb;
        s.dst[k - s.begin] = blk[size_t(j * a + i)];
      }
    }
  }
  return b;
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
