// HF safetensors into the model, through the parameter table: whole models, slices of them (each rank's ZeRO shard)
// and PEFT adapter folders. The layout conversions are the model's (model/weights.cpp: hf_shape, from_hf_layout).
#include "q3vl/io/hf_weights.hpp"

#include <algorithm>
#include <map>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/io/safetensors.hpp"
#include "q3vl/model/lora.hpp"
#include "q3vl/tensor/tensor.hpp"  // shape_str

namespace q3vl {

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
void load_hf_weights(HostWeights& m, const std::string& dir) {
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

// One slice of table tensor s.param, read from tensor `name` of st (its on-disk layout: released-layout MoE
// experts are read an expert at a time, whole, and transposed). Returns the bytes read.
static int64_t read_hf_slice(const ParamTable& t, const Safetensors& st, const std::string& name, const ParamSlice& s) {
  if (s.count == 0) return 0;
  const ParamInfo& p = t.param(s.param);
  const int64_t es = int64_t(st_dtype_size(st.info(name).dtype));
  if (!hf_expert(t, s.param) || t.config().experts_v5_layout) {  // same layout on disk
    st.read_f32_range(name, s.begin, s.count, s.dst);
    return s.count * es;
  }
  // Compute layout [E, a, b], disk [E, b, a]: read each expert the slice touches, take its part transposed.
  const int64_t a = p.shape[1], bb = p.shape[2], n = a * bb;
  std::vector<float> blk(size_t(n), 0.f);
  int64_t bytes = 0;
  for (int64_t e = s.begin / n; e <= (s.begin + s.count - 1) / n; ++e) {
    st.read_f32_range(name, e * n, n, blk.data());
    bytes += n * es;
    const int64_t lo = std::max(s.begin, e * n), hi = std::min(s.begin + s.count, (e + 1) * n);
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t i = (k - e * n) / bb, j = (k - e * n) % bb;
      s.dst[k - s.begin] = blk[size_t(j * a + i)];
    }
  }
  return bytes;
}

SliceBytes load_hf_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices) {
  const Safetensors st = Safetensors::open(dir);
  check_hf_tensors(t, st, dir);
  SliceBytes b;
  for (const ParamInfo& p : t.params())
    if (p.part != Part::Lora) b.all += int64_t(st.info(p.name).nbytes);
  for (const ParamSlice& s : slices) {
    const ParamInfo& p = t.param(s.param);
    if (p.part == Part::Lora) fail("load_hf_slices: " + p.name + " is an adapter (load it with load_lora_slices)");
    b.mine += read_hf_slice(t, st, p.name, s);
  }
  return b;
}

// The names under which PEFT may save base parameter `id` beside the adapters, in PEFT's load order: its module's
// state-dict key in the PEFT model, "base_model.model.<module>.base_layer.<leaf>" when lora.targets wraps the module
// (PEFT saves a wrapped embedding layer's or lm_head's full weights so), else "base_model.model.<module>.<leaf>"
// (save_embedding_layers = True, modules_to_save). A tied head is the embedding: "lm_head"'s names come after the
// embedding's, since PEFT's load_state_dict copies into the one storage module by module and lm_head comes last.
static std::vector<std::string> peft_base_names(const ParamTable& t, int id) {
  const auto name_of = [&](const std::string& full) {
    const size_t dot = full.rfind('.');
    const std::string module = full.substr(0, dot);
    const bool wrapped = t.find(module + ".lora_A.weight") >= 0;
    return peft_name(module + (wrapped ? ".base_layer" : "") + full.substr(dot));
  };
  std::vector<std::string> names{name_of(t.param(id).name)};
  if (id == t.lm_head() && t.param(id).name != "lm_head.weight") names.push_back(name_of("lm_head.weight"));
  return names;
}

// Tensor n of an adapter file against the shape `want`; `why` follows the wanted shape in the message.
static void check_adapter_shape(const Safetensors& st, const std::string& file, const std::string& n,
                                const std::vector<int64_t>& want, const std::string& why) {
  if (st.info(n).shape != want)
    fail(file + ": tensor " + n + " has shape " + shape_str(st.info(n).shape) + ", " + why + " " + shape_str(want));
}

static std::string unexpected_adapter_tensor(const std::string& file, const std::string& name) {
  const size_t at = name.find(".base_layer."), pre = peft_name("").size();
  return file + ": unexpected tensor " + name + " (not an adapter of this model under lora.targets" +
         (at != std::string::npos && at > pre
              ? "; PEFT saves the full weights of a layer it wraps so, and lora.targets does not wrap " +
                    name.substr(pre, at - pre)
              : std::string()) +
         ")";
}

// Per table parameter, the tensor of a PEFT adapter file that gives its value ("": a base parameter the file leaves
// to the base), after checking the file: every adapter present with its shape, base weights with the base's
// on-disk shape, nothing else.
static std::vector<std::string> adapter_sources(const ParamTable& t, const Safetensors& st, const std::string& file) {
  std::vector<std::string> src(t.params().size());
  std::map<std::string, int> known;  // every name the file may hold -> its parameter
  for (size_t id = 0; id < t.params().size(); ++id) {
    const ParamInfo& p = t.params()[id];
    if (p.part == Part::Lora) {
      const std::string n = peft_name(p.name);
      if (!st.has(n))
        fail(file + ": missing tensor " + n + " " + shape_str(p.shape) + " (lora.targets wraps " +
             p.name.substr(0, p.name.rfind(".lora_")) + "; the adapter does not)");
      check_adapter_shape(st, file, n, p.shape, "lora.rank and the model need");
      known[n] = int(id);
      src[id] = n;
      continue;
    }
    for (const std::string& n : peft_base_names(t, int(id))) {
      known[n] = int(id);
      if (!st.has(n)) continue;
      check_adapter_shape(st, file, n, hf_shape(t, int(id)),
                          "but it replaces the base model's " + p.name + " (PEFT saves a layer's full weights so), of shape");
      src[id] = n;  // a later name wins, as in PEFT's load order
    }
  }
  for (const auto& [name, info] : st.tensors())
    if (!known.count(name)) fail(unexpected_adapter_tensor(file, name));
  return src;
}

SliceBytes load_lora_slices(const ParamTable& t, const std::string& dir, const std::vector<ParamSlice>& slices) {
  const std::string file = dir + "/adapter_model.safetensors";
  const Safetensors st = Safetensors::open(file);
  const std::vector<std::string> src = adapter_sources(t, st, file);
  SliceBytes b;
  std::string replaced;
  for (size_t id = 0; id < src.size(); ++id) {
    if (src[id].empty()) continue;
    b.all += int64_t(st.info(src[id]).nbytes);
    if (t.param(int(id)).part != Part::Lora)
      replaced += (replaced.empty() ? "" : ", ") + t.param(int(id)).name + " by " + src[id];
  }
  if (!replaced.empty() && Log::get().rank() == 0)
    log_info("lora.adapter " + dir + ": the PEFT folder replaces the base's " + replaced);
  for (const ParamSlice& s : slices)
    if (!src[size_t(s.param)].empty()) b.mine += read_hf_slice(t, st, src[size_t(s.param)], s);
  return b;
}

void load_lora_adapter(HostWeights& m, const std::string& dir) {
  std::vector<ParamSlice> all;
  for (size_t id = 0; id < m.table().params().size(); ++id)
    all.push_back({int(id), 0, m.table().params()[id].numel, m.param(int(id))});
  load_lora_slices(m.table(), dir, all);
}

}  // namespace q3vl
