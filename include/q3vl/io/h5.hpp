// Small serial HDF5 helper: RAII file handle, typed dataset read/write with shapes, scalar attributes,
// listing. Dataset names are paths ("grads/model.visual.blocks.0.attn.qkv.weight"; dots are ordinary
// characters in HDF5). Every failure is a q3vl::Error naming the file and the dataset; HDF5's own error
// printing is switched off. The collective checkpoint writer is separate (parallel HDF5).
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace q3vl {

class H5File {
 public:
  enum class Mode { Read, ReadWrite };
  static H5File open(const std::string& path, Mode mode = Mode::Read);
  static H5File create(const std::string& path);  // truncates an existing file
  H5File(H5File&& o) noexcept;
  H5File& operator=(H5File&& o) noexcept;
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;
  ~H5File();

  const std::string& path() const { return path_; }
  bool exists(const std::string& name) const;                  // dataset or group, any depth
  bool is_dataset(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& dataset) const;  // {} for a scalar
  // Dataset paths below `group` ("/" for all), relative to it, sorted, recursive.
  std::vector<std::string> list(const std::string& group = "/") const;

  // Reads a whole dataset as T (float, double, int64_t, int32_t, uint8_t). Integers convert to floats and
  // floats to floats (f64 -> f32 rounds); a float dataset is never read as an integer type.
  template <class T> std::vector<T> read(const std::string& dataset, std::vector<int64_t>* shape = nullptr) const;
  template <class T> T read_scalar(const std::string& dataset) const;  // a dataset of exactly one element
  // Writes a new dataset (error if it exists), creating intermediate groups. Empty shape = scalar.
  template <class T> void write(const std::string& dataset, const std::vector<int64_t>& shape, const T* data);
  template <class T> void write(const std::string& dataset, const std::vector<int64_t>& shape, const std::vector<T>& v) {
    write(dataset, shape, v.data());
  }
  template <class T> void write_scalar(const std::string& dataset, T value) { write(dataset, {}, &value); }
  void write_string(const std::string& dataset, const std::string& value);
  std::string read_string(const std::string& dataset) const;

  // Scalar attributes on a group or dataset ("/" = the file). Setting replaces an existing attribute.
  void set_attr(const std::string& object, const std::string& name, double value);
  void set_attr(const std::string& object, const std::string& name, int64_t value);
  void set_attr(const std::string& object, const std::string& name, const std::string& value);
  void set_attr(const std::string& object, const std::string& name, const char* value) {
    set_attr(object, name, std::string(value));
  }
  bool has_attr(const std::string& object, const std::string& name) const;
  double attr_double(const std::string& object, const std::string& name) const;
  int64_t attr_int(const std::string& object, const std::string& name) const;
  std::string attr_string(const std::string& object, const std::string& name) const;

  hid_t id() const { return id_; }  // for code that needs the raw handle

 private:
  H5File(hid_t id, std::string path) : id_(id), path_(std::move(path)) {}
  hid_t id_ = -1;
  std::string path_;
};

}  // namespace q3vl
