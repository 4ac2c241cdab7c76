#include "q3vl/io/checkpoint.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include "q3vl/core/debug.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"

namespace q3vl {
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "q3vl-checkpoint";
constexpr int64_t kVersion = 1;
int64_t g_io_chunk = int64_t(1) << 28;

// Owns one HDF5 id and closes it with the matching function.
class Hid {
 public:
  Hid() = default;
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Hid& operator=(Hid&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  Hid(const Hid&) = delete;
  ~Hid() { reset(); }
  // Closes now and reports whether the close succeeded (closing a file flushes it).
  bool reset() {
    bool ok = id_ < 0 || close_(id_) >= 0;
    id_ = -1;
    return ok;
  }
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

void quiet() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The innermost message on HDF5's error stack (e.g. "truncated file: eof = ..."), read right after a
// failed call.
std::string h5_reason() {
  std::string last;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* d) -> herr_t {
        if (e->desc && *e->desc) *static_cast<std::string*>(d) = e->desc;
        return 0;
      },
      &last);
  return last.empty() ? "unknown HDF5 error" : last;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

bool numel_of(const std::vector<int64_t>& shape, int64_t* n) {
  int64_t p = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(p, d, &p)) return false;
  *n = p;
  return true;
}

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// ---- MPI agreement ----

int comm_rank(MPI_Comm c) {
  int r = 0;
  MPI_Comm_rank(c, &r);
  return r;
}
int comm_size(MPI_Comm c) {
  int n = 1;
  MPI_Comm_size(c, &n);
  return n;
}

std::string bcast_string(MPI_Comm comm, std::string s, int root) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, root, comm);
  s.resize(static_cast<size_t>(n));
  for (long long off = 0; off < n;) {  // in pieces: MPI counts are int
    int piece = static_cast<int>(std::min<long long>(n - off, 1 << 30));
    MPI_Bcast(s.data() + off, piece, MPI_CHAR, root, comm);
    off += piece;
  }
  return s;
}

// Throws, on every rank, the message of the lowest rank `first` that has one (ranks >= size have none).
[[noreturn]] void throw_from(MPI_Comm comm, int first, const std::string& err) {
  std::string msg = bcast_string(comm, err, first);
  if (comm_size(comm) > 1) msg = "rank " + std::to_string(first) + ": " + msg;
  fail_all(msg);
}

// Collective: if any rank has an error, every rank throws the lowest such rank's message.
void agree(MPI_Comm comm, const std::string& err) {
  int size = comm_size(comm);
  int mine = err.empty() ? size : comm_rank(comm), first = size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first < size) throw_from(comm, first, err);
}

uint64_t list_hash(const std::vector<CkptSlice>& slices) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  auto add = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ULL;
  };
  for (const auto& s : slices) {
    add(s.dataset.data(), s.dataset.size() + 1);
    size_t nd = s.shape.size();
    add(&nd, sizeof nd);
    add(s.shape.data(), nd * sizeof(int64_t));
  }
  return h;
}

// One MAX all-reduce settles everything before the first HDF5 call (collectives are what costs when ranks
// share cores): whether a rank has an error (then every rank throws the lowest such rank's message),
// whether every rank has the same tensor list (else the collective HDF5 calls would mismatch: a hang or a
// corrupt file), and how many I/O rounds each slice takes. Returns the rounds.
std::vector<int64_t> prelude(MPI_Comm comm, const std::string& err, const std::vector<CkptSlice>& slices,
                             const char* what) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const int64_t h = static_cast<int64_t>(list_hash(slices));
  std::vector<int64_t> v{err.empty() ? 0 : size - rank, h, ~h};  // max(~h) == ~min(h)
  for (const auto& s : slices) v.push_back(err.empty() ? (s.count + g_io_chunk - 1) / g_io_chunk : 0);
  // Lists of different lengths cannot be reduced together: reduce the common prefix plus the length.
  int64_t len = static_cast<int64_t>(v.size()), lo_len = len;
  MPI_Allreduce(&len, &lo_len, 1, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(lo_len), MPI_INT64_T, MPI_MAX, comm);
  if (v[0] > 0) throw_from(comm, size - static_cast<int>(v[0]), err);
  if (lo_len != len || v[1] != ~v[2])
    fail_all(std::string(what) +
             ": the ranks were given different tensor lists (names, shapes and order must match on every rank)");
  return std::vector<int64_t>(v.begin() + 3, v.end());
}

std::string check_slices(const std::vector<CkptSlice>& slices, const char* what) {
  std::set<std::string> seen;
  for (const auto& s : slices) {
    std::string w = std::string(what) + ": tensor '" + s.dataset + "'";
    const std::string& d = s.dataset;
    if (d.empty() || d.front() == '/' || d.back() == '/' || d.find("//") != std::string::npos)
      return w + ": bad dataset name";
    if (!seen.insert(d).second) return w + ": listed twice";
    int64_t n = 0;
    if (!numel_of(s.shape, &n)) return w + ": bad shape " + shape_str(s.shape);
    if (s.begin < 0 || s.count < 0 || s.begin > n || s.count > n - s.begin)
      return w + ": slice [" + std::to_string(s.begin) + ", +" + std::to_string(s.count) + ") is outside its " +
             std::to_string(n) + " elements";
    if (s.count > 0 && !s.data) return w + ": no data buffer";
  }
  return "";
}

// Per slice, over all ranks: elements held and the sum of their checksums (mod 2^64), in one all-reduce.
void count_and_checksum(MPI_Comm comm, const std::vector<CkptSlice>& slices, std::vector<int64_t>* counts,
                        std::vector<uint64_t>* sums) {
  const size_t n = slices.size();
  std::vector<uint64_t> v(2 * n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<uint64_t>(slices[i].count);
    v[n + i] = ckpt_checksum(slices[i].data, slices[i].begin, slices[i].count);
  }
  if (n) MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(2 * n), MPI_UINT64_T, MPI_SUM, comm);
  counts->assign(v.begin(), v.begin() + n);
  sums->assign(v.begin() + n, v.end());
}

// Rank 0's metadata on every rank (the values written must be identical everywhere).
CkptMeta bcast_meta(MPI_Comm comm, const CkptMeta& m) {
  std::string packed;
  for (const std::string* s : {&m.deck_toml, &m.state_json, &m.build, &m.hf_config_json, &m.run_id}) {
    uint64_t n = s->size();
    packed.append(reinterpret_cast<const char*>(&n), 8).append(*s);
  }
  packed.append(reinterpret_cast<const char*>(&m.step), 8).append(reinterpret_cast<const char*>(&m.tokens_seen), 8);
  packed = bcast_string(comm, packed, 0);
  CkptMeta out = m;
  size_t pos = 0;
  for (std::string* s : {&out.deck_toml, &out.state_json, &out.build, &out.hf_config_json, &out.run_id}) {
    uint64_t n;
    std::memcpy(&n, packed.data() + pos, 8);
    *s = packed.substr(pos + 8, n);
    pos += 8 + n;
  }
  std::memcpy(&out.step, packed.data() + pos, 8);
  std::memcpy(&out.tokens_seen, packed.data() + pos + 8, 8);
  return out;
}

// ---- HDF5 pieces ----

// ROMIO takes what precedes a colon in a file name for a file-system type ("lustre:", "ufs:") and refuses a path
// such as "runs/lr:3e-3/..." as an unsupported one; naming the generic driver keeps such paths working.
std::string mpiio_name(const std::string& path) {
  return path.find(':') == std::string::npos ? path : "ufs:" + path;
}

Hid parallel_fapl(MPI_Comm comm) {
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL) < 0) fail_all("checkpoint: cannot set up the MPI-IO driver");
  H5Pset_all_coll_metadata_ops(fapl, 1);
  H5Pset_coll_metadata_write(fapl, 1);
  // Fixed format bounds: the same bytes whatever the library's defaults, readable by any HDF5 >= 1.8.
  H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_V18);
  return fapl;
}

// Independent data transfers: each rank's elements are one contiguous range of the file, so two-phase
// collective buffering buys nothing, while its several collectives per dataset made a 4-rank checkpoint of
// the tiny model take 17 s instead of 1.3 s on oversubscribed cores. Metadata stays collective.
Hid transfer_dxpl() {
  Hid dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_INDEPENDENT);
  return dxpl;
}

Hid vlen_utf8() {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, H5T_VARIABLE);
  H5Tset_cset(t, H5T_CSET_UTF8);
  return t;
}

void set_attr_raw(hid_t obj, const char* name, hid_t ftype, hid_t mtype, const void* v, const std::string& w) {
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid a(H5Acreate2(obj, name, ftype, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!a.ok() || H5Awrite(a, mtype, v) < 0) fail_all(w + ": cannot write attribute '" + name + "': " + h5_reason());
}
void set_attr(hid_t obj, const char* name, int64_t v, const std::string& w) {
  set_attr_raw(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, w);
}
void set_attr(hid_t obj, const char* name, uint64_t v, const std::string& w) {
  set_attr_raw(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v, w);
}
void set_attr(hid_t obj, const char* name, const std::string& v, const std::string& w) {
  Hid t = vlen_utf8();
  const char* p = v.c_str();
  set_attr_raw(obj, name, t, t, &p, w);
}

// Attribute readers: "" on success, else why not.
std::string get_attr_int(hid_t obj, const char* name, int64_t* out) {
  if (H5Aexists(obj, name) <= 0) return std::string("no attribute '") + name + "'";
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Hid t(a.ok() ? H5Aget_type(a) : -1, H5Tclose);
  if (!t.ok() || H5Tget_class(t) != H5T_INTEGER) return std::string("attribute '") + name + "' is not an integer";
  if (H5Aread(a, H5T_NATIVE_INT64, out) < 0) return std::string("cannot read attribute '") + name + "'";
  return "";
}
std::string get_attr_u64(hid_t obj, const char* name, uint64_t* out) {
  if (H5Aexists(obj, name) <= 0) return std::string("no attribute '") + name + "'";
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!a.ok() || H5Aread(a, H5T_NATIVE_UINT64, out) < 0) return std::string("cannot read attribute '") + name + "'";
  return "";
}
std::string get_attr_str(hid_t obj, const char* name, std::string* out) {
  if (H5Aexists(obj, name) <= 0) return std::string("no attribute '") + name + "'";
  Hid a(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Hid t(a.ok() ? H5Aget_type(a) : -1, H5Tclose);
  if (!t.ok() || H5Tget_class(t) != H5T_STRING || H5Tis_variable_str(t) <= 0)
    return std::string("attribute '") + name + "' is not a variable-length string";
  Hid mt = vlen_utf8();
  char* s = nullptr;
  if (H5Aread(a, mt, &s) < 0) return std::string("cannot read attribute '") + name + "'";
  *out = s ? s : "";
  std::free(s);  // HDF5 allocates variable-length strings with malloc
  return "";
}

// Opens a checkpoint serially: "" and the file in *f, or why it cannot be a checkpoint.
std::string open_serial(const std::string& path, Hid* f) {
  quiet();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return "no such file";
  htri_t is = H5Fis_hdf5(path.c_str());
  if (is == 0) return "not an HDF5 file";
  if (is < 0) return "cannot be read: " + h5_reason();
  *f = Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!f->ok()) return "damaged or truncated (" + h5_reason() + ")";
  std::string format;
  if (!get_attr_str(*f, "format", &format).empty() || format != kFormat)
    return std::string("not a q3vl checkpoint (no root attribute format = \"") + kFormat + "\")";
  int64_t version = 0;
  if (std::string e = get_attr_int(*f, "format_version", &version); !e.empty()) return e;
  if (version != kVersion)
    return "format_version " + std::to_string(version) + " (this build reads " + std::to_string(kVersion) + ")";
  return "";
}

std::string read_meta(hid_t f, CkptMeta* m) {
  int64_t ws = 0;
  for (auto [name, dst] : std::initializer_list<std::pair<const char*, int64_t*>>{
           {"step", &m->step}, {"tokens_seen", &m->tokens_seen}, {"world_size", &ws}})
    if (std::string e = get_attr_int(f, name, dst); !e.empty()) return e;
  m->world_size = static_cast<int>(ws);
  for (auto [name, dst] : std::initializer_list<std::pair<const char*, std::string*>>{
           {"deck", &m->deck_toml}, {"state_json", &m->state_json}, {"build", &m->build}})
    if (std::string e = get_attr_str(f, name, dst); !e.empty()) return e;
  // Optional: files written before they were kept still resume.
  if (H5Aexists(f, "run_id") > 0)
    if (std::string e = get_attr_str(f, "run_id", &m->run_id); !e.empty()) return e;
  if (H5Aexists(f, "hf_config_json") > 0) return get_attr_str(f, "hf_config_json", &m->hf_config_json);
  return "";
}

std::string dataset_shape(hid_t d, std::vector<int64_t>* shape) {
  Hid space(H5Dget_space(d), H5Sclose);
  int nd = space.ok() ? H5Sget_simple_extent_ndims(space) : -1;
  if (nd < 0) return "cannot read its dataspace";
  std::vector<hsize_t> dims(nd);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  shape->assign(dims.begin(), dims.end());
  return "";
}

// Whether `path` names an object, checking each prefix (H5Lexists needs the parents to exist).
bool object_exists(hid_t f, const std::string& path) {
  for (size_t pos = 0;;) {
    size_t slash = path.find('/', pos);
    std::string prefix = path.substr(0, slash);
    if (H5Lexists(f, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (slash == std::string::npos) return H5Oexists_by_name(f, path.c_str(), H5P_DEFAULT) > 0;
    pos = slash + 1;
  }
}

// File selection for elements [begin, begin+count) of a dataset of `shape`.
Hid select_range(const std::vector<int64_t>& shape, int64_t begin, int64_t count, const std::string& w) {
  Hid space = shape.empty() ? Hid(H5Screate(H5S_SCALAR), H5Sclose) : [&] {
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    return Hid(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  }();
  if (!space.ok()) fail(w + ": cannot make its dataspace");
  herr_t rc = 0;
  if (count == 0) {
    rc = H5Sselect_none(space);
  } else if (shape.empty()) {
    rc = H5Sselect_all(space);
  } else {
    auto boxes = flat_range_boxes(shape, begin, count);
    for (size_t i = 0; i < boxes.size() && rc >= 0; ++i) {
      std::vector<hsize_t> start(boxes[i].start.begin(), boxes[i].start.end());
      std::vector<hsize_t> cnt(boxes[i].count.begin(), boxes[i].count.end());
      rc = H5Sselect_hyperslab(space, i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, start.data(), nullptr, cnt.data(),
                               nullptr);
    }
  }
  if (rc < 0) fail(w + ": cannot select elements: " + h5_reason());
  return space;
}

// One transfer per round of at most g_io_chunk elements (MPI-IO counts stay far below 2^31); a rank whose
// slice is done takes part with an empty selection.
void transfer(hid_t dset, const CkptSlice& s, int64_t rounds, hid_t dxpl, bool write, const std::string& w) {
  float dummy = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    int64_t off = std::min(s.count, r * g_io_chunk);
    int64_t n = std::min(s.count - off, g_io_chunk);
    Hid file_space = select_range(s.shape, s.begin + off, n, w);
    hsize_t mdim = static_cast<hsize_t>(std::max<int64_t>(n, 1));
    Hid mem(H5Screate_simple(1, &mdim, nullptr), H5Sclose);
    if (n == 0) H5Sselect_none(mem);
    float* buf = n ? s.data + off : &dummy;
    herr_t rc = write ? H5Dwrite(dset, H5T_NATIVE_FLOAT, mem, file_space, dxpl, buf)
                      : H5Dread(dset, H5T_NATIVE_FLOAT, mem, file_space, dxpl, buf);
    if (rc < 0) fail(w + (write ? ": write failed: " : ": read failed: ") + h5_reason());
  }
}

std::string without_trailing_slash(std::string d) {
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d;
}

std::string step_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "step_%08lld.h5", static_cast<long long>(step));
  return buf;
}

// Complete checkpoints (step_N.h5) and interrupted ones (step_N.h5.partial) in dir, by step.
struct DirListing {
  std::vector<std::pair<int64_t, std::string>> complete, partial;
};
DirListing list_dir(const std::string& dir) {
  static const std::regex re(R"(step_(\d{8,18})\.h5(\.partial)?)");
  DirListing out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, re)) continue;
    (m[2].matched ? out.partial : out.complete).emplace_back(std::stoll(m[1].str()), name);
  }
  auto newest_first = [](const auto& a, const auto& b) { return a.first > b.first; };
  std::sort(out.complete.begin(), out.complete.end(), newest_first);
  std::sort(out.partial.begin(), out.partial.end(), newest_first);
  return out;
}

// So that a rename survives a crash of the machine, not only of the process.
void fsync_path(const std::string& path, bool dir) {
  int fd = ::open(path.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// The run that wrote a complete checkpoint ("" for files written before runs had ids), or nullopt where its
// attributes cannot be read.
std::optional<std::string> run_of(const std::string& path) {
  Hid f;
  CkptMeta m;
  if (!open_serial(path, &f).empty() || !read_meta(f, &m).empty()) return std::nullopt;
  return m.run_id;
}

// Rank 0 after every rank closed the .partial: publish it, point `latest` at it, prune. "" or the error.
std::string publish(const std::string& dir, const std::string& partial, const std::string& final_name,
                    int64_t step, const std::string& run_id, int keep_last) {
  std::string final_path = dir + "/" + final_name;
  fsync_path(partial, false);
  if (std::rename(partial.c_str(), final_path.c_str()) != 0)
    return "checkpoint: cannot rename '" + partial + "' to '" + final_path + "': " + std::strerror(errno);
  fsync_path(dir, true);
  std::string tmp = dir + "/latest.tmp", latest = dir + "/latest";
  {
    std::ofstream o(tmp, std::ios::trunc);
    o << final_name << "\n";
    o.flush();
    if (!o) return "checkpoint: cannot write '" + tmp + "'";
  }
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), latest.c_str()) != 0)
    return "checkpoint: cannot rename '" + tmp + "' to '" + latest + "': " + std::strerror(errno);
  fsync_path(dir, true);

  // Prune: the written checkpoint always stays; of this run's others, the newest keep_last-1 by step. Another
  // run's files (or unreadable ones) are never deleted: a checkpoint someone may still want is not ours to lose.
  DirListing l = list_dir(dir);
  int kept = 1;
  for (const auto& [s, name] : l.complete) {
    if (name == final_name) continue;
    if (run_of(dir + "/" + name) != run_id) continue;
    if (s > step) log_warn("checkpoint: " + dir + "/" + name + " is newer than the step just written (" +
                           std::to_string(step) + ")");
    if (keep_last <= 0 || kept < keep_last) {
      ++kept;
      continue;
    }
    std::error_code ec;
    if (!fs::remove(dir + "/" + name, ec) && ec)
      log_warn("checkpoint: cannot remove old '" + dir + "/" + name + "': " + ec.message());
  }
  for (const auto& [s, name] : l.partial) {  // left by interrupted writes
    std::error_code ec;
    fs::remove(dir + "/" + name, ec);
  }
  return "";
}

}  // namespace

// ---- building blocks ----

namespace {
void boxes_rec(const std::vector<int64_t>& shape, const std::vector<int64_t>& inner, size_t level,
               std::vector<int64_t>& prefix, int64_t b, int64_t e, std::vector<CkptBox>& out) {
  if (b >= e) return;
  const size_t nd = shape.size();
  if (level + 1 == nd) {  // innermost: one run
    CkptBox box{prefix, std::vector<int64_t>(prefix.size(), 1)};
    box.start.push_back(b);
    box.count.push_back(e - b);
    out.push_back(std::move(box));
    return;
  }
  const int64_t in = inner[level];
  int64_t r0 = b / in, r1 = e / in;
  auto sub = [&](int64_t row, int64_t sb, int64_t se) {
    prefix.push_back(row);
    boxes_rec(shape, inner, level + 1, prefix, sb, se, out);
    prefix.pop_back();
  };
  if (r0 == r1) return sub(r0, b - r0 * in, e - r0 * in);  // inside one row
  if (b % in) sub(r0++, b % in, in);                        // partial leading row
  if (r1 > r0) {                                            // full rows
    CkptBox box{prefix, std::vector<int64_t>(prefix.size(), 1)};
    box.start.push_back(r0);
    box.count.push_back(r1 - r0);
    for (size_t k = level + 1; k < nd; ++k) box.start.push_back(0), box.count.push_back(shape[k]);
    out.push_back(std::move(box));
  }
  if (e % in) sub(r1, 0, e % in);  // partial trailing row
}
}  // namespace

std::vector<CkptBox> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t count) {
  int64_t n = 0;
  if (!numel_of(shape, &n) || begin < 0 || count < 0 || begin > n || count > n - begin)
    fail("flat_range_boxes: range [" + std::to_string(begin) + ", +" + std::to_string(count) +
         ") does not fit shape " + shape_str(shape));
  std::vector<CkptBox> out;
  if (count == 0) return out;
  if (shape.empty()) return {CkptBox{}};  // a scalar: its one element
  std::vector<int64_t> inner(shape.size(), 1), prefix;
  for (size_t k = shape.size() - 1; k > 0; --k) inner[k - 1] = inner[k] * shape[k];
  boxes_rec(shape, inner, 0, prefix, begin, begin + count, out);
  return out;
}

void set_checkpoint_io_chunk(int64_t elements) {
  if (elements < 1) fail("set_checkpoint_io_chunk: needs at least 1 element");
  g_io_chunk = elements;
}

uint64_t file_checksum(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '" + path + "' to verify its checksum");
  std::vector<char> buf(size_t(1) << 20);  // a multiple of 4: words stay aligned across reads
  uint64_t sum = 0;
  int64_t words = 0;
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    const size_t got = size_t(in.gcount());
    if (got == 0) break;
    std::fill(buf.begin() + std::ptrdiff_t(got), buf.begin() + std::ptrdiff_t((got + 3) / 4 * 4), 0);
    const int64_t n = int64_t((got + 3) / 4);
    sum += ckpt_checksum(reinterpret_cast<const float*>(buf.data()), words, n);
    words += n;
  }
  if (in.bad()) fail("cannot read '" + path + "' to verify its checksum");
  return sum;
}

uint64_t ckpt_checksum(const float* data, int64_t begin, int64_t count) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, data + i, 4);
    sum += mix64(mix64(static_cast<uint64_t>(begin + i)) + bits);
  }
  return sum;
}

// ---- write ----

std::string write_checkpoint(const std::string& dir_in, MPI_Comm comm, const CkptMeta& meta_in,
                             const std::vector<CkptSlice>& slices, int keep_last) {
  quiet();
  const std::string dir = without_trailing_slash(dir_in);
  const int rank = comm_rank(comm), size = comm_size(comm);
  const CkptMeta meta = bcast_meta(comm, meta_in);
  std::string err = meta.step < 0 ? "write_checkpoint: negative step " + std::to_string(meta.step)
                                  : check_slices(slices, "write_checkpoint");
  if (rank == 0 && err.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) err = "write_checkpoint: cannot create directory '" + dir + "': " + ec.message();
  }
  const std::vector<int64_t> rounds = prelude(comm, err, slices, "write_checkpoint");

  // Every element written exactly once: the ranks' counts add up to each tensor's size.
  std::vector<int64_t> counts;
  std::vector<uint64_t> sums;
  count_and_checksum(comm, slices, &counts, &sums);
  for (size_t i = 0; i < slices.size(); ++i) {
    int64_t n = 0;
    numel_of(slices[i].shape, &n);
    if (counts[i] != n)
      fail_all("write_checkpoint: tensor '" + slices[i].dataset + "' " + shape_str(slices[i].shape) +
               ": the ranks' slices hold " + std::to_string(counts[i]) + " of its " + std::to_string(n) +
               " elements");
  }

  const std::string final_name = step_name(meta.step);
  const std::string partial = dir + "/" + final_name + ".partial";

  {
    const std::string w = "checkpoint '" + partial + "'";
    Hid fapl = parallel_fapl(comm);
    Hid fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
    H5Pset_obj_track_times(fcpl, 0);  // no timestamps: same inputs, same bytes
    Hid file(H5Fcreate(mpiio_name(partial).c_str(), H5F_ACC_TRUNC, fcpl, fapl), H5Fclose);
    if (!file.ok()) fail_all(w + ": cannot create: " + h5_reason());

    set_attr(file, "format", std::string(kFormat), w);
    set_attr(file, "format_version", kVersion, w);
    set_attr(file, "step", meta.step, w);
    set_attr(file, "tokens_seen", meta.tokens_seen, w);
    set_attr(file, "world_size", int64_t(size), w);
    set_attr(file, "deck", meta.deck_toml, w);
    set_attr(file, "state_json", meta.state_json, w);
    set_attr(file, "build", meta.build, w);
    set_attr(file, "hf_config_json", meta.hf_config_json, w);
    set_attr(file, "run_id", meta.run_id, w);

    Hid gcpl(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
    H5Pset_obj_track_times(gcpl, 0);
    Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    H5Pset_obj_track_times(dcpl, 0);
    H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);
    H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER);  // every element is written below
    std::set<std::string> groups;
    Hid dxpl = transfer_dxpl();
    for (size_t i = 0; i < slices.size(); ++i) {
      const CkptSlice& s = slices[i];
      const std::string ws = w + ": tensor '" + s.dataset + "'";
      for (size_t p = s.dataset.find('/'); p != std::string::npos; p = s.dataset.find('/', p + 1)) {
        std::string g = s.dataset.substr(0, p);
        if (!groups.insert(g).second) continue;
        Hid gid(H5Gcreate2(file, g.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT), H5Gclose);
        if (!gid.ok()) fail_all(w + ": cannot create group '" + g + "': " + h5_reason());
      }
      Hid space = s.shape.empty() ? Hid(H5Screate(H5S_SCALAR), H5Sclose) : [&] {
        std::vector<hsize_t> dims(s.shape.begin(), s.shape.end());
        return Hid(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
      }();
      Hid d(H5Dcreate2(file, s.dataset.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
            H5Dclose);
      if (!d.ok()) fail_all(ws + ": cannot create dataset: " + h5_reason());
      set_attr(d, "checksum", sums[i], ws);
      transfer(d, s, rounds[i], dxpl, true, ws);
      if (i == 0) debug_stop_point("checkpoint");  // test hook: a rank stops in the middle of a write
    }
    if (H5Fflush(file, H5F_SCOPE_GLOBAL) < 0) fail_all(w + ": flush failed: " + h5_reason());
    if (!file.reset()) fail_all(w + ": close failed: " + h5_reason());
  }

  MPI_Barrier(comm);  // every rank's data is in the file before it is published
  agree(comm, rank == 0 ? publish(dir, partial, final_name, meta.step, meta.run_id, keep_last) : "");
  return dir + "/" + final_name;
}

// ---- read ----

CkptMeta read_checkpoint_meta(const std::string& path) {
  Hid f;
  CkptMeta m;
  std::string e = open_serial(path, &f);
  if (e.empty()) e = read_meta(f, &m);
  if (!e.empty()) fail("checkpoint '" + path + "': " + e);
  return m;
}

void read_checkpoint(const std::string& path, MPI_Comm comm, const std::vector<CkptSlice>& slices) {
  quiet();
  // A clear message for a missing, foreign or damaged file before the collective open.
  std::string e = check_slices(slices, "read_checkpoint");
  if (comm_rank(comm) == 0 && e.empty()) {
    Hid f;
    e = open_serial(path, &f);
    if (!e.empty()) e = "checkpoint '" + path + "': " + e;
  }
  const std::vector<int64_t> rounds = prelude(comm, e, slices, "read_checkpoint");

  Hid fapl = parallel_fapl(comm);
  Hid file(H5Fopen(mpiio_name(path).c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
  if (!file.ok()) fail_all("checkpoint '" + path + "': cannot open: " + h5_reason());

  // All shapes first: a different model is refused before anything is read.
  std::vector<Hid> dsets;
  for (const auto& s : slices) {
    const std::string head = "checkpoint '" + path + "' was written for a different model: tensor " + s.dataset;
    if (!object_exists(file, s.dataset))
      fail_all(head + " is missing from the file (shape " + shape_str(s.shape) + " in this model)");
    Hid d(H5Dopen2(file, s.dataset.c_str(), H5P_DEFAULT), H5Dclose);
    if (!d.ok()) fail_all(head + " is not a dataset in the file");
    std::vector<int64_t> shape;
    if (std::string err = dataset_shape(d, &shape); !err.empty())
      fail_all("checkpoint '" + path + "': tensor " + s.dataset + ": " + err);
    if (shape != s.shape)
      fail_all(head + " has shape " + shape_str(shape) + " in the file, " + shape_str(s.shape) + " in this model");
    Hid t(H5Dget_type(d), H5Tclose);
    if (H5Tget_class(t) != H5T_FLOAT) fail_all("checkpoint '" + path + "': tensor " + s.dataset + " is not float");
    dsets.push_back(std::move(d));
  }

  Hid dxpl = transfer_dxpl();
  for (size_t i = 0; i < slices.size(); ++i)
    transfer(dsets[i], slices[i], rounds[i], dxpl, false, "checkpoint '" + path + "': tensor " + slices[i].dataset);
  // Verify each tensor that the ranks read whole.
  std::vector<int64_t> counts;
  std::vector<uint64_t> sums;
  count_and_checksum(comm, slices, &counts, &sums);
  for (size_t i = 0; i < slices.size(); ++i) {
    int64_t n = 0;
    numel_of(slices[i].shape, &n);
    uint64_t stored = 0;
    if (counts[i] != n || !get_attr_u64(dsets[i], "checksum", &stored).empty()) continue;
    if (stored != sums[i])
      fail_all("checkpoint '" + path + "' is corrupt: tensor " + slices[i].dataset +
               " does not match its checksum");
  }
}

std::map<std::string, std::vector<int64_t>> checkpoint_shapes(const std::string& path) {
  Hid f;
  if (std::string e = open_serial(path, &f); !e.empty()) fail("checkpoint '" + path + "': " + e);
  std::map<std::string, std::vector<int64_t>> out;
  if (!object_exists(f, "model")) return out;
  struct Ctx {
    std::map<std::string, std::vector<int64_t>>* out;
    std::string err;
  } ctx{&out, ""};
  auto cb = [](hid_t g, const char* name, const H5O_info_t* info, void* p) -> herr_t {
    auto* c = static_cast<Ctx*>(p);
    if (info->type != H5O_TYPE_DATASET) return 0;
    Hid d(H5Dopen2(g, name, H5P_DEFAULT), H5Dclose);
    std::vector<int64_t> shape;
    c->err = d.ok() ? dataset_shape(d, &shape) : "cannot open";
    if (!c->err.empty()) c->err = std::string("tensor model/") + name + ": " + c->err;
    (*c->out)[std::string("model/") + name] = shape;
    return c->err.empty() ? 0 : -1;
  };
  if (H5Ovisit_by_name(f, "model", H5_INDEX_NAME, H5_ITER_INC, cb, &ctx, H5P_DEFAULT) < 0)
    fail("checkpoint '" + path + "': " + (ctx.err.empty() ? "cannot list model/" : ctx.err));
  return out;
}

// ---- resume ----

std::string checkpoint_problem(const std::string& path) {
  Hid f;
  if (std::string e = open_serial(path, &f); !e.empty()) return e;
  CkptMeta m;
  if (std::string e = read_meta(f, &m); !e.empty()) return e;
  static const std::regex re(R"(step_(\d+)\.h5)");
  std::smatch match;
  std::string name = fs::path(path).filename().string();
  if (std::regex_match(name, match, re) && std::stoll(match[1].str()) != m.step)
    return "its step attribute is " + std::to_string(m.step);
  // Every dataset fully stored inside the file.
  struct Ctx {
    uint64_t file_size;
    std::string err;
  } ctx{0, ""};
  std::error_code ec;
  ctx.file_size = fs::file_size(path, ec);
  auto cb = [](hid_t g, const char* name, const H5O_info_t* info, void* p) -> herr_t {
    auto* c = static_cast<Ctx*>(p);
    if (info->type != H5O_TYPE_DATASET) return 0;
    Hid d(H5Dopen2(g, name, H5P_DEFAULT), H5Dclose);
    std::vector<int64_t> shape;
    int64_t n = 0;
    if (!d.ok() || !dataset_shape(d, &shape).empty() || !numel_of(shape, &n)) {
      c->err = std::string("dataset ") + name + " cannot be opened";
      return -1;
    }
    hsize_t stored = H5Dget_storage_size(d);
    haddr_t off = H5Dget_offset(d);
    if (stored != static_cast<hsize_t>(n) * 4 ||
        (n > 0 && (off == HADDR_UNDEF || off + stored > c->file_size))) {
      c->err = std::string("dataset ") + name + " is not fully stored in the file";
      return -1;
    }
    return 0;
  };
  if (H5Ovisit(f, H5_INDEX_NAME, H5_ITER_INC, cb, &ctx) < 0)
    return ctx.err.empty() ? "cannot list its datasets: " + h5_reason() : ctx.err;
  return "";
}

std::vector<std::string> resume_candidates(const std::string& dir_in, std::vector<std::string>* notes) {
  const std::string dir = without_trailing_slash(dir_in);
  auto note = [&](const std::string& s, bool warn) {
    if (notes) notes->push_back(s);
    if (warn && Log::get().rank() == 0) log_warn(s);
  };
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    note("no checkpoint directory '" + dir + "'", false);
    return {};
  }
  DirListing l = list_dir(dir);
  for (const auto& [s, name] : l.partial)
    note("ignoring " + dir + "/" + name + " (an interrupted write)", false);
  std::string latest;
  if (std::ifstream in(dir + "/latest"); in) std::getline(in, latest);

  std::vector<std::string> out;
  for (const auto& [s, name] : l.complete) {
    std::string path = dir + "/" + name;
    if (std::string why = checkpoint_problem(path); !why.empty()) {
      note("skipping " + path + ": " + why, true);
      continue;
    }
    // `latest` is written after the rename, so a crash in between leaves it one behind: step order wins. It
    // names a newer step when that one was damaged and skipped above.
    if (out.empty() && !latest.empty() && latest != name) {
      static const std::regex step_re(R"(step_(\d{8,18})\.h5)");
      std::smatch m;
      const bool newer = std::regex_match(latest, m, step_re) && std::stoll(m[1].str()) > s;
      note("'latest' names " + latest + (newer ? ", which is damaged or missing; " + name + " is the newest complete one"
                                                : ", but " + name + " is newer"),
           false);
    }
    if (out.empty()) note("resuming from " + path, false);
    out.push_back(path);
  }
  if (out.empty()) note("no complete checkpoint in '" + dir + "'", false);
  return out;
}

std::string find_resume_checkpoint(const std::string& dir, std::vector<std::string>* notes) {
  const std::vector<std::string> c = resume_candidates(dir, notes);
  return c.empty() ? "" : c.front();
}

std::vector<std::string> other_runs_checkpoints(const std::string& dir_in, const std::string& run_id) {
  const std::string dir = without_trailing_slash(dir_in);
  std::vector<std::string> out;
  for (const auto& [s, name] : list_dir(dir).complete)
    if (const auto r = run_of(dir + "/" + name); !r || *r != run_id) out.push_back(dir + "/" + name);
  return out;
}

std::string move_checkpoints_aside(const std::string& dir_in, const std::vector<std::string>& files) {
  const std::string dir = without_trailing_slash(dir_in);
  std::string aside;
  for (int k = 1;; ++k)  // the first free name: earlier replacements stay as they were
    if (aside = dir + "/replaced." + std::to_string(k); !fs::exists(aside)) break;
  std::error_code ec;
  fs::create_directories(aside, ec);
  if (ec) fail("checkpoint.overwrite: cannot create '" + aside + "': " + ec.message());
  for (const std::string& f : files) {
    fs::rename(f, aside + "/" + fs::path(f).filename().string(), ec);
    if (ec) fail("checkpoint.overwrite: cannot move '" + f + "' to '" + aside + "': " + ec.message());
  }
  if (fs::exists(dir + "/latest")) fs::rename(dir + "/latest", aside + "/latest", ec);
  fsync_path(dir, true);
  return aside;
}

}  // namespace q3vl
