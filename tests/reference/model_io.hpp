// The product's weight functions (io/hf_weights.hpp, model/weights.hpp, serve/tp.hpp) work on HostWeights; these
// overloads give the test reference model (BasicModel<float>) the same ones, through a HostWeights copy.
#pragma once
#include <string>
#include <vector>

#include "q3vl/io/hf_weights.hpp"
#include "qwen3vl.hpp"
#include "q3vl/model/weights.hpp"
#include "q3vl/serve/tp.hpp"

namespace q3vl {

// The parts of w's tensors m's table holds (all of them, or its experts under expert parallelism) into m.
inline void copy_weights(const HostWeights& w, Model& m) {
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    const float* src = w.param(w.table().id(p.name)) + p.held_begin;
    std::copy(src, src + p.held, m.param(int(id)));
  }
}
// m's weights (a whole table) into w.
inline void copy_weights(Model& m, HostWeights& w) {
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    const ParamInfo& p = m.table().params()[id];
    std::copy(m.param(int(id)), m.param(int(id)) + p.numel, w.param(w.table().id(p.name)));
  }
}

inline void load_hf_weights(Model& m, const std::string& dir) {
  HostWeights w(m.config());
  load_hf_weights(w, dir);
  copy_weights(w, m);
}

inline void load_lora_adapter(Model& m, const std::string& dir) {
  HostWeights w(m.config());
  copy_weights(m, w);
  load_lora_adapter(w, dir);
  copy_weights(w, m);
}

// Gradients the model does not hold (frozen parameters) are zeros.
inline std::vector<NamedTensor> grads_hf(Model& m) {
  HostWeights w(m.config(), true);
  for (size_t id = 0; id < m.table().params().size(); ++id)
    if (const float* g = m.grad(int(id)))
      std::copy(g, g + m.table().params()[id].numel, w.grad(int(id)));
  return grads_hf(w);
}

inline void tp_shard_weights(Model& full, Model& local, int rank, int size, int ep = 1) {
  auto dst = [&](int id) { return local.param(id); };
  for (const ParamSlice& p : tp_slices(full.table(), local.table(), rank, size, dst, ep))
    std::copy(full.param(p.param) + p.begin, full.param(p.param) + p.begin + p.count, p.dst);
}

}  // namespace q3vl
