// The host reference of the device model's int8 weights (model.weight_dtype = "int8"): every DevModel::int8_param
// weight of a host model quantized and dequantized again in place, over the rows the device quantizes
// (DevModel::int8_rows), so the host computes with the matrices the device holds and only the arithmetic differs.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "q3vl/model/dev_model.hpp"
#include "reference/qwen3vl.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl::test {

// Returns {weights quantized, of them expert tensors [E, out, in]}.
inline std::pair<int, int> dequantize_int8_params(Model& m) {
  int quantized = 0, experts = 0;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    if (!DevModel::int8_param(m.table(), int(id))) continue;
    const ParamInfo& p = m.table().param(int(id));
    const int64_t rows = DevModel::int8_rows(p), cols = p.numel / rows;
    std::vector<int8_t> q(size_t(p.numel));
    std::vector<float> sc(static_cast<size_t>(rows));
    float* w = m.param(int(id));
    ops::quantize_int8_rows(w, rows, cols, q.data(), sc.data());
    for (int64_t i = 0; i < p.numel; ++i) w[i] = float(q[size_t(i)]) * sc[size_t(i / cols)];
    quantized++, experts += p.shape.size() == 3;
  }
  return {quantized, experts};
}

}  // namespace q3vl::test
