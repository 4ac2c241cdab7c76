// Test helpers: small Hugging Face model directories (config.json + model.safetensors) written from a model.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "q3vl/io/safetensors.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/weights.hpp"

namespace q3vl::test {

using TensorList = std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, const float*>>>;

// m's weights under their HF names, in the on-disk shape and layout of m's config; `keep` holds the data.
template <class W>  // HostWeights or the test reference's Model
TensorList hf_tensors(W& m, std::vector<std::vector<float>>& keep) {
  const ParamTable& t = m.table();
  keep.clear();
  keep.reserve(t.params().size());
  TensorList ts;
  for (size_t id = 0; id < t.params().size(); ++id) {
    keep.push_back(to_hf_layout(t, int(id), m.param(int(id))));
    ts.push_back({t.param(int(id)).name, {hf_shape(t, int(id)), keep.back().data()}});
  }
  return ts;
}

// dir/config.json: the config.json `from` with transformers_version = `version` (below 5: MoE experts in the
// released layout, else the transformers-5 one). Returns the config as load_hf_config reads it back.
inline ModelConfig write_hf_config(const std::string& dir, const std::string& from, const std::string& version) {
  std::filesystem::create_directories(dir);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(from));
  j["transformers_version"] = version;
  std::ofstream(dir + "/config.json") << j.dump(2);
  return load_hf_config(dir + "/config.json");
}

// An HF directory holding a random init (seed, std 0.5) of `from`'s config in dtype dt.
inline ModelConfig write_hf_dir(const std::string& dir, const std::string& from, const std::string& version,
                                StDtype dt, uint64_t seed) {
  const ModelConfig cfg = write_hf_config(dir, from, version);
  HostWeights m(cfg);
  m.init_random(seed, 0.5);
  std::vector<std::vector<float>> keep;
  write_safetensors(dir + "/model.safetensors", hf_tensors(m, keep), dt);
  return cfg;
}

}  // namespace q3vl::test
