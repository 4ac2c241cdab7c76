// Hugging Face safetensors: read one file or a sharded directory (model.safetensors.index.json), write one file.
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:[b,e]}},
// then the data section; offsets are relative to the start of the data section.
// Reading uses pread on demand: checkpoints are tens of GB and are never loaded whole.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "q3vl/core/dtype.hpp"  // bf16/fp16 conversions

namespace q3vl {

enum class StDtype { F32, F16, BF16, F64, I64, I32, U8, BOOL };

// Bytes per element, and the format's dtype name ("F32", "BF16", ...).
size_t st_dtype_size(StDtype dt);
const char* st_dtype_name(StDtype dt);

struct StTensor {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  std::string file;     // the file that holds it
  uint64_t offset;      // absolute byte offset in that file
  uint64_t nbytes;
};

class Safetensors {  // one file, or a dir with model.safetensors or model.safetensors.index.json (sharded)
 public:
  static Safetensors open(const std::string& file_or_dir);
  const std::map<std::string, StTensor>& tensors() const { return tensors_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const StTensor& info(const std::string& name) const;          // error naming tensor + file if absent
  std::vector<float> read_f32(const std::string& name) const;   // converts BF16/F16/F32/F64; error names file+tensor if truncated
  // Elements [begin, begin+count) of the row-major flattening into out[0, count), reading only their bytes (a
  // rank's shard of a tensor); error names file+tensor if the range is outside the tensor or the file is truncated.
  void read_f32_range(const std::string& name, int64_t begin, int64_t count, float* out) const;

 private:
  std::string source_;  // what open() was given, for messages
  std::map<std::string, StTensor> tensors_;
};

// Writes one file. F32 input is stored as F32, BF16 (round to nearest even) or F16 (round to nearest even).
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, const float*>>>& tensors,
                       StDtype dtype = StDtype::F32);


}  // namespace q3vl
