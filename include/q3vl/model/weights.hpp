// A model's fp32 weights on the host, through the parameter table: what loading (io/hf_weights.hpp), LoRA folding,
// tensor-parallel slicing and eval's gradient dumps hold before the device model (model/dev_model.hpp) takes them.
// Also the conversions between our compute layout and the on-disk (HF) layout, and the seeded initial values.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "q3vl/model/config.hpp"
#include "q3vl/model/params.hpp"

namespace q3vl {

// Every parameter of the table in one flat fp32 store, all units concatenated (unit u at table().units()[u].offset,
// the layout DevModel::set_params takes); gradients (the same layout) only when asked for.
class HostWeights {
 public:
  // ep: only this rank's share of each MoE layer's experts (ParamTable's split).
  explicit HostWeights(const ModelConfig& cfg, bool with_grads = false, ExpertSplit ep = {});
  const ModelConfig& config() const { return table_.config(); }
  const ParamTable& table() const { return table_; }
  float* params() { return p_.data(); }
  const float* params() const { return p_.data(); }
  float* param(int id) { return p_.data() + at(id); }
  const float* param(int id) const { return p_.data() + at(id); }
  float* grads() { return g_.empty() ? nullptr : g_.data(); }
  float* grad(int id) { return g_.data() + at(id); }
  const float* grad(int id) const { return g_.data() + at(id); }
  // Norm weights 1, biases 0, everything else N(0, std^2): the values of init_param_range.
  void init_random(uint64_t seed, double std = 0.02);

 private:
  int64_t at(int id) const;
  ParamTable table_;
  std::vector<float> p_, g_;
};

// On-disk shape of a table tensor for this config (differs from the compute shape only for MoE experts).
std::vector<int64_t> hf_shape(const ParamTable& t, int id);
// Convert one tensor (weights or grads) from our compute layout to the on-disk layout (copy for everything but
// MoE experts, which are transposed in the released layout).
std::vector<float> to_hf_layout(const ParamTable& t, int id, const float* data);
// The other way: a tensor as read from the file (on-disk layout) in our compute layout.
std::vector<float> from_hf_layout(const ParamTable& t, int id, std::vector<float> disk);
// Whether a table tensor is a MoE layer's experts (their layout on disk depends on config.experts_v5_layout).
bool hf_expert(const ParamTable& t, int id);
// Every gradient under its HF name, in the on-disk shape and layout (for eval's grads/<hf name> dumps); with LoRA
// on, the adapters' only, under PEFT's names.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};
std::vector<NamedTensor> grads_hf(const HostWeights& w);

// Elements [begin, begin+count) of table tensor `param` (row-major, compute layout), written to dst[0, count):
// e.g. a rank's ZeRO shard of that tensor (ZeroShards::master_slices()).
struct ParamSlice {
  int param = 0;
  int64_t begin = 0, count = 0;
  float* dst = nullptr;
};
struct SliceBytes {
  int64_t mine = 0, all = 0;  // bytes read (or drawn) for the slices, and for the whole model
};
// HostWeights::init_random's values for slices only (bitwise the same).
SliceBytes init_random_slices(const ParamTable& t, uint64_t seed, double std, const std::vector<ParamSlice>& slices);
// The initial value of element j of a tensor is a pure function of (seed, its name, j, std) - a counter-based
// normal (splitmix64 hash of the counter into Box-Muller) - so that any slice can be drawn without the rest and
// the weights do not depend on how they are sharded. no_decay tensors: 0 for ".bias", else 1.
template <class T>
void init_param_range(const ParamInfo& p, uint64_t seed, double std, int64_t begin, int64_t count, T* out);

}  // namespace q3vl
