#include "q3vl/tensor/tensor.hpp"

#include <cstdlib>
#include <cstring>

#include "q3vl/core/error.hpp"

namespace q3vl {

namespace {
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }
}  // namespace

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType t) {
  Tensor x;
  x.shape_ = std::move(shape);
  x.dtype_ = t;
  size_t bytes = std::max<size_t>(x.nbytes(), 1);
  // 64-byte alignment for SIMD and BLAS.
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) fail("out of host memory allocating " + x.describe() + " (" + std::to_string(bytes) + " bytes)");
  std::memset(p, 0, bytes);
  x.storage_ = std::shared_ptr<void>(p, std::free);
  x.data_ = p;
  return x;
}

Tensor Tensor::wrap(void* data, std::vector<int64_t> shape, DType t, Device d) {
  Tensor x;
  x.data_ = data;
  x.shape_ = std::move(shape);
  x.dtype_ = t;
  x.device_ = d;
  return x;
}

Tensor Tensor::adopt(void* data, std::vector<int64_t> shape, DType t, Device d, void (*deleter)(void*)) {
  Tensor x = wrap(data, std::move(shape), t, d);
  x.storage_ = std::shared_ptr<void>(data, deleter);
  return x;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  Q3VL_CHECK(i >= 0 && i < n, "dimension " + std::to_string(i) + " of " + describe());
  return shape_[size_t(i)];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (auto s : shape_) n *= s;
  return n;
}

template <class T>
T* Tensor::ptr() const {
  if (dtype_ != dtype_of<T>()) fail("tensor " + describe() + " accessed as " + dtype_name(dtype_of<T>()));
  return static_cast<T*>(data_);
}
template float* Tensor::ptr<float>() const;
template double* Tensor::ptr<double>() const;
template int32_t* Tensor::ptr<int32_t>() const;
template int64_t* Tensor::ptr<int64_t>() const;
template uint8_t* Tensor::ptr<uint8_t>() const;

Tensor Tensor::view(std::vector<int64_t> shape) const {
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) fail("view of " + describe() + " as " + shape_str(shape) + ": more than one -1");
      infer = int(i);
    } else known *= shape[i];
  }
  if (infer >= 0 && known > 0) shape[size_t(infer)] = numel() / known;
  Tensor v = *this;
  v.shape_ = shape;
  if (v.numel() != numel()) fail("view of " + describe() + " as " + shape_str(shape) + ": element counts differ");
  return v;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  Q3VL_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
             "slice [" + std::to_string(begin) + "," + std::to_string(end) + ") of " + describe());
  Tensor v = *this;
  int64_t row = numel() / std::max<int64_t>(shape_[0], 1);
  v.shape_[0] = end - begin;
  v.data_ = static_cast<char*>(data_) + size_t(begin * row) * dtype_size(dtype_);
  return v;
}

Tensor Tensor::flat(int64_t offset, int64_t count) const {
  Q3VL_CHECK(offset >= 0 && count >= 0 && offset + count <= numel(),
             "flat window [" + std::to_string(offset) + ",+" + std::to_string(count) + ") of " + describe());
  Tensor v = *this;
  v.shape_ = {count};
  v.data_ = static_cast<char*>(data_) + size_t(offset) * dtype_size(dtype_);
  return v;
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + (device_ == Device::CPU ? " cpu" : " cuda");
}

}  // namespace q3vl
