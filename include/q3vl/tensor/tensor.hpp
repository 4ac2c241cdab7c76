// A Tensor is a typed, shaped, contiguous view of memory on one device. Views share storage; ownership
// is reference counted so a view may outlive the tensor it came from.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "q3vl/core/dtype.hpp"

namespace q3vl {

enum class Device { CPU, CUDA };

class Tensor {
 public:
  Tensor() = default;
  // Host tensor, zero-filled.
  static Tensor zeros(std::vector<int64_t> shape, DType t);
  // Non-owning view of existing memory.
  static Tensor wrap(void* data, std::vector<int64_t> shape, DType t, Device d = Device::CPU);
  // Owning tensor over memory that `deleter` frees (backends allocate through this).
  static Tensor adopt(void* data, std::vector<int64_t> shape, DType t, Device d, void (*deleter)(void*));

  const std::vector<int64_t>& shape() const { return shape_; }
  int ndim() const { return int(shape_.size()); }
  int64_t dim(int i) const;  // negative counts from the end
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool defined() const { return data_ != nullptr || numel() == 0; }
  void* data() const { return data_; }
  template <class T>
  T* ptr() const;  // checks that T matches dtype()

  Tensor view(std::vector<int64_t> shape) const;           // same numel; -1 infers one dimension
  Tensor slice(int64_t begin, int64_t end) const;          // rows [begin,end) of dim 0
  Tensor flat(int64_t offset, int64_t count) const;        // 1-D window of the flattened tensor
  std::string describe() const;                            // "fp32[2,3] cpu"

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  std::vector<int64_t> shape_;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
};

std::string shape_str(const std::vector<int64_t>& s);

}  // namespace q3vl
