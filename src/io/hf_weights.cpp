// HF safetensors into the model, through the parameter table: whole models, slices of them (each rank's ZeRO shard)
// and PEFT adapter folders. The layout conversions are the model's (model/weights.cpp: hf_shape, from_hf_layout).
#include "q3vl/io/hf_weights.hpp"

#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/io/safetensors.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/tensor/tensor.hpp"  // shape_str

namespace q3vl {

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
           (hf_expert(t, int(id)) ? std::string(" (expert layout: ") + (v5 ? "transformers-5 module" : "released") +
                                    ", chosen by transformers_version in config.json)"
                              : std::string()));
  }
  for (const auto& [name, info] : st.tensors())
    if (t.find(name) < 0)
      fail(dir + ": unexpected tensor " + name + " " + shape_str(info.shape) +
           (name == "lm_head.weight" ? " (config.json ties the word embeddings)" : ""));
}

// Whole tensors, converted with from_hf_layout: the reference the sliced reads below are tested against.
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
    const std::vector<float> v = from_hf_layout(t, int(id), st.read_f32(p.name));  // disk -> compute
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
    if (!hf_expert(t, s.param) || t.config().experts_v5_layout) {  // same layout on disk
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

}  // namespace q3vl
