// The host reference of the device model's 8-bit weights (model.weight_dtype = "int8" or "fp8"): every
// DevModel::quant_param weight of a host model quantized in that format and dequantized again in place, over the rows
// the device quantizes (DevModel::quant_rows), so the host computes with the matrices the device holds and only the
// arithmetic differs.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "q3vl/model/dev_model.hpp"
#include "reference/qwen3vl.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl::test {

// Returns {weights quantized, of them expert tensors [E, out, in]}.
inline std::pair<int, int> dequantize_q8_params(Model& m, QFormat f = QFormat::Int8) {
  int quantized = 0, experts = 0;
  for (size_t id = 0; id < m.table().params().size(); ++id) {
    if (!DevModel::quant_param(m.table(), int(id))) continue;
    const ParamInfo& p = m.table().param(int(id));
    const int64_t rows = DevModel::quant_rows(p), cols = p.numel / rows;
    std::vector<uint8_t> q(size_t(p.numel));
    std::vector<float> sc(static_cast<size_t>(rows));
    float* w = m.param(int(id));
    ops::quantize_rows(f, w, rows, cols, q.data(), sc.data());
    for (int64_t i = 0; i < p.numel; ++i) {
      const uint8_t b = q[size_t(i)];
      w[i] = (f == QFormat::Int8 ? float(int8_t(b)) : fp8_e4m3_to_f32(b)) * sc[size_t(i / cols)];
    }
    quantized++, experts += p.shape.size() == 3;
  }
  return {quantized, experts};
}

}  // namespace q3vl::test
