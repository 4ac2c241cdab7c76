#include "q3vl/io/h5.hpp"

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "q3vl/core/error.hpp"

namespace q3vl {
namespace {

// Owns one HDF5 id and closes it with the matching function.
class Hid {
 public:
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  ~Hid() { if (id_ >= 0) close_(id_); }
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// HDF5 prints its error stack to stderr by default; we report errors ourselves.
void quiet() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

template <class T> hid_t mem_type() {
  if constexpr (std::is_same_v<T, float>) return H5T_NATIVE_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return H5T_NATIVE_DOUBLE;
  else if constexpr (std::is_same_v<T, int64_t>) return H5T_NATIVE_INT64;
  else if constexpr (std::is_same_v<T, int32_t>) return H5T_NATIVE_INT32;
  else if constexpr (std::is_same_v<T, uint8_t>) return H5T_NATIVE_UINT8;
  else static_assert(!sizeof(T), "H5File: unsupported element type");
}

template <class T> const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, double>) return "f64";
  else if constexpr (std::is_same_v<T, int64_t>) return "i64";
  else if constexpr (std::is_same_v<T, int32_t>) return "i32";
  else return "u8";
}

std::string where(const std::string& file, const std::string& name) { return "h5: '" + file + "': '" + name + "'"; }

std::string norm_obj(const std::string& o) { return o.empty() ? "/" : o; }

Hid open_dataset(hid_t file, const std::string& path, const std::string& name) {
  quiet();
  if (H5Lexists(file, "/", H5P_DEFAULT) < 0) fail("h5: '" + path + "' is not open");
  Hid d(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!d.ok()) fail(where(path, name) + ": no such dataset");
  return d;
}

std::vector<int64_t> space_shape(hid_t space, const std::string& w) {
  int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail(w + ": cannot read the dataspace");
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

Hid open_object(hid_t file, const std::string& path, const std::string& obj) {
  quiet();
  Hid o(H5Oopen(file, norm_obj(obj).c_str(), H5P_DEFAULT), H5Oclose);
  if (!o.ok()) fail(where(path, obj) + ": no such group or dataset");
  return o;
}

void write_attr(hid_t file, const std::string& path, const std::string& obj, const std::string& name, hid_t ftype,
                hid_t mtype, const void* value) {
  Hid o = open_object(file, path, obj);
  if (H5Aexists(o, name.c_str()) > 0) H5Adelete(o, name.c_str());
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid a(H5Acreate2(o, name.c_str(), ftype, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!a.ok() || H5Awrite(a, mtype, value) < 0) fail(where(path, obj) + ": cannot write attribute '" + name + "'");
}

Hid open_attr(hid_t file, const std::string& path, const std::string& obj, const std::string& name) {
  Hid a(H5Aopen_by_name(file, norm_obj(obj).c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!a.ok()) fail(where(path, obj) + ": no attribute '" + name + "'");
  return a;
}

// A variable-length string type (what h5py writes for str), UTF-8.
Hid vlen_string_type() {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, H5T_VARIABLE);
  H5Tset_cset(t, H5T_CSET_UTF8);
  return t;
}

// Reads a scalar string attribute or dataset, fixed or variable length.
template <class ReadFn>
std::string read_str(hid_t ftype, const std::string& w, ReadFn read) {
  if (H5Tget_class(ftype) != H5T_STRING) fail(w + ": is not a string");
  if (H5Tis_variable_str(ftype) > 0) {
    Hid mt = vlen_string_type();
    char* s = nullptr;
    if (read(static_cast<hid_t>(mt), &s) < 0) fail(w + ": cannot read string");
    std::string r = s ? s : "";
    std::free(s);  // HDF5 allocates variable-length strings with malloc
    return r;
  }
  size_t n = H5Tget_size(ftype);
  Hid mt(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mt, n + 1);
  std::string buf(n + 1, '\0');
  if (read(static_cast<hid_t>(mt), buf.data()) < 0) fail(w + ": cannot read string");
  buf.resize(std::char_traits<char>::length(buf.c_str()));
  return buf;
}

}  // namespace

H5File H5File::open(const std::string& path, Mode mode) {
  quiet();
  hid_t id = H5Fopen(path.c_str(), mode == Mode::Read ? H5F_ACC_RDONLY : H5F_ACC_RDWR, H5P_DEFAULT);
  if (id < 0) fail("h5: cannot open '" + path + "' (missing, not HDF5, or no permission)");
  return H5File(id, path);
}

H5File H5File::create(const std::string& path) {
  quiet();
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (id < 0) fail("h5: cannot create '" + path + "'");
  return H5File(id, path);
}

H5File::H5File(H5File&& o) noexcept : id_(o.id_), path_(std::move(o.path_)) { o.id_ = -1; }

H5File& H5File::operator=(H5File&& o) noexcept {
  if (this != &o) {
    if (id_ >= 0) H5Fclose(id_);
    id_ = o.id_, path_ = std::move(o.path_), o.id_ = -1;
  }
  return *this;
}

H5File::~H5File() {
  if (id_ >= 0) H5Fclose(id_);
}

bool H5File::exists(const std::string& name) const {
  quiet();
  if (name.empty() || name == "/") return true;
  // H5Lexists fails on a missing intermediate group, so test each prefix in turn.
  size_t pos = 0;
  while (true) {
    pos = name.find('/', pos + 1);
    std::string prefix = name.substr(0, pos);
    if (!prefix.empty() && prefix != "/" && H5Lexists(id_, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (pos == std::string::npos) return true;
  }
}

bool H5File::is_dataset(const std::string& name) const {
  if (!exists(name)) return false;
  Hid o(H5Oopen(id_, name.c_str(), H5P_DEFAULT), H5Oclose);
  return o.ok() && H5Iget_type(o) == H5I_DATASET;
}

std::vector<int64_t> H5File::shape(const std::string& dataset) const {
  Hid d = open_dataset(id_, path_, dataset);
  Hid s(H5Dget_space(d), H5Sclose);
  return space_shape(s, where(path_, dataset));
}

std::vector<std::string> H5File::list(const std::string& group) const {
  quiet();
  if (!exists(group)) fail(where(path_, group) + ": no such group");
  std::vector<std::string> out;
  auto cb = [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
    if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->push_back(name);
    return 0;
  };
#if H5_VERSION_GE(1, 12, 0)
  herr_t rc = H5Ovisit_by_name(id_, norm_obj(group).c_str(), H5_INDEX_NAME, H5_ITER_INC, cb, &out, H5O_INFO_BASIC,
                               H5P_DEFAULT);
#else
  herr_t rc = H5Ovisit_by_name(id_, norm_obj(group).c_str(), H5_INDEX_NAME, H5_ITER_INC, cb, &out, H5P_DEFAULT);
#endif
  if (rc < 0)
    fail(where(path_, group) + ": cannot list");
  std::sort(out.begin(), out.end());
  return out;
}

template <class T>
std::vector<T> H5File::read(const std::string& dataset, std::vector<int64_t>* shape_out) const {
  Hid d = open_dataset(id_, path_, dataset);
  const std::string w = where(path_, dataset);
  Hid s(H5Dget_space(d), H5Sclose);
  std::vector<int64_t> shp = space_shape(s, w);
  Hid ft(H5Dget_type(d), H5Tclose);
  const H5T_class_t cls = H5Tget_class(ft);
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) fail(w + ": is not a numeric dataset");
  if (cls == H5T_FLOAT && std::is_integral_v<T>)
    fail(w + ": holds floating-point data; refusing to read it as " + type_name<T>());
  int64_t n = 1;
  for (int64_t x : shp) n *= x;
  std::vector<T> v(static_cast<size_t>(n));
  // HDF5 clips out-of-range values silently by default; make that an error instead.
  Hid dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  H5Pset_type_conv_cb(
      dxpl,
      [](H5T_conv_except_t e, hid_t, hid_t, void*, void*, void*) -> H5T_conv_ret_t {
        return e == H5T_CONV_EXCEPT_RANGE_HI || e == H5T_CONV_EXCEPT_RANGE_LOW ? H5T_CONV_ABORT : H5T_CONV_UNHANDLED;
      },
      nullptr);
  if (n > 0 && H5Dread(d, mem_type<T>(), H5S_ALL, H5S_ALL, dxpl, v.data()) < 0)
    fail(w + ": read as " + type_name<T>() + " failed (value out of range or corrupt file)");
  if (shape_out) *shape_out = shp;
  return v;
}

template <class T>
T H5File::read_scalar(const std::string& dataset) const {
  std::vector<int64_t> shp;
  std::vector<T> v = read<T>(dataset, &shp);
  if (v.size() != 1) fail(where(path_, dataset) + ": expected one value, found " + std::to_string(v.size()));
  return v[0];
}

template <class T>
void H5File::write(const std::string& dataset, const std::vector<int64_t>& shape, const T* data) {
  quiet();
  const std::string w = where(path_, dataset);
  if (exists(dataset)) fail(w + ": already exists");
  std::vector<hsize_t> dims;
  for (int64_t x : shape) {
    if (x < 0) fail(w + ": negative dimension");
    dims.push_back(static_cast<hsize_t>(x));
  }
  Hid space(shape.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
            H5Sclose);
  Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl, 1);
  Hid d(H5Dcreate2(id_, dataset.c_str(), mem_type<T>(), space, lcpl, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  if (!d.ok()) fail(w + ": cannot create dataset (read-only file, or a parent is a dataset?)");
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  if (n > 0 && H5Dwrite(d, mem_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) fail(w + ": write failed");
}

void H5File::write_string(const std::string& dataset, const std::string& value) {
  quiet();
  const std::string w = where(path_, dataset);
  if (exists(dataset)) fail(w + ": already exists");
  Hid t = vlen_string_type();
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl, 1);
  Hid d(H5Dcreate2(id_, dataset.c_str(), t, space, lcpl, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  const char* p = value.c_str();
  if (!d.ok() || H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, &p) < 0) fail(w + ": cannot write string");
}

std::string H5File::read_string(const std::string& dataset) const {
  Hid d = open_dataset(id_, path_, dataset);
  Hid ft(H5Dget_type(d), H5Tclose);
  return read_str(ft, where(path_, dataset),
                  [&](hid_t mt, void* buf) { return H5Dread(d, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf); });
}

void H5File::set_attr(const std::string& object, const std::string& name, double value) {
  write_attr(id_, path_, object, name, H5T_NATIVE_DOUBLE, H5T_NATIVE_DOUBLE, &value);
}

void H5File::set_attr(const std::string& object, const std::string& name, int64_t value) {
  write_attr(id_, path_, object, name, H5T_NATIVE_INT64, H5T_NATIVE_INT64, &value);
}

void H5File::set_attr(const std::string& object, const std::string& name, const std::string& value) {
  Hid t = vlen_string_type();
  const char* p = value.c_str();
  write_attr(id_, path_, object, name, t, t, &p);
}

bool H5File::has_attr(const std::string& object, const std::string& name) const {
  if (!exists(object)) return false;
  return H5Aexists_by_name(id_, norm_obj(object).c_str(), name.c_str(), H5P_DEFAULT) > 0;
}

double H5File::attr_double(const std::string& object, const std::string& name) const {
  open_object(id_, path_, object);  // names a missing object rather than a missing attribute
  Hid a = open_attr(id_, path_, object, name);
  Hid ft(H5Aget_type(a), H5Tclose);
  if (H5Tget_class(ft) != H5T_FLOAT && H5Tget_class(ft) != H5T_INTEGER)
    fail(where(path_, object) + ": attribute '" + name + "' is not a number");
  double v = 0;
  if (H5Aread(a, H5T_NATIVE_DOUBLE, &v) < 0) fail(where(path_, object) + ": cannot read attribute '" + name + "'");
  return v;
}

int64_t H5File::attr_int(const std::string& object, const std::string& name) const {
  open_object(id_, path_, object);  // names a missing object rather than a missing attribute
  Hid a = open_attr(id_, path_, object, name);
  Hid ft(H5Aget_type(a), H5Tclose);
  if (H5Tget_class(ft) != H5T_INTEGER) fail(where(path_, object) + ": attribute '" + name + "' is not an integer");
  int64_t v = 0;
  if (H5Aread(a, H5T_NATIVE_INT64, &v) < 0) fail(where(path_, object) + ": cannot read attribute '" + name + "'");
  return v;
}

std::string H5File::attr_string(const std::string& object, const std::string& name) const {
  open_object(id_, path_, object);  // names a missing object rather than a missing attribute
  Hid a = open_attr(id_, path_, object, name);
  Hid ft(H5Aget_type(a), H5Tclose);
  return read_str(ft, where(path_, object) + ": attribute '" + name + "'",
                  [&](hid_t mt, void* buf) { return H5Aread(a, mt, buf); });
}

#define Q3VL_H5_INSTANTIATE(T)                                                                          \
  template std::vector<T> H5File::read<T>(const std::string&, std::vector<int64_t>*) const;           \
  template T H5File::read_scalar<T>(const std::string&) const;                                        \
  template void H5File::write<T>(const std::string&, const std::vector<int64_t>&, const T*);
Q3VL_H5_INSTANTIATE(float)
Q3VL_H5_INSTANTIATE(double)
Q3VL_H5_INSTANTIATE(int64_t)
Q3VL_H5_INSTANTIATE(int32_t)
Q3VL_H5_INSTANTIATE(uint8_t)
#undef Q3VL_H5_INSTANTIATE

}  // namespace q3vl
