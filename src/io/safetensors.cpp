#include "q3vl/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "q3vl/core/dtype.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/tensor/tensor.hpp"

namespace q3vl {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The safetensors reference implementation refuses headers above 100 MB; so do we, to catch garbage lengths early.
constexpr uint64_t kMaxHeader = 100ull << 20;

struct Fd {  // closes on scope exit
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() { if (fd >= 0) ::close(fd); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// Reads exactly n bytes at off; returns the number read (less only at end of file).
size_t pread_full(int fd, void* buf, size_t n, uint64_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, static_cast<char*>(buf) + got, n - got, static_cast<off_t>(off + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

bool parse_dtype(const std::string& s, StDtype& dt) {
  static const std::pair<const char*, StDtype> table[] = {
      {"F32", StDtype::F32}, {"F16", StDtype::F16}, {"BF16", StDtype::BF16}, {"F64", StDtype::F64},
      {"I64", StDtype::I64}, {"I32", StDtype::I32}, {"U8", StDtype::U8},     {"BOOL", StDtype::BOOL}};
  for (auto& [name, d] : table)
    if (s == name) return dt = d, true;
  return false;
}

// Parses one file's header and checks every entry against the file size.
void parse_file(const std::string& path, std::map<std::string, StTensor>& out) {
  Fd f(::open(path.c_str(), O_RDONLY));
  if (f.fd < 0) fail("safetensors: cannot open '" + path + "': " + std::strerror(errno));
  struct stat st{};
  if (::fstat(f.fd, &st) != 0) fail("safetensors: cannot stat '" + path + "': " + std::strerror(errno));
  const uint64_t fsize = static_cast<uint64_t>(st.st_size);
  unsigned char lenbuf[8];
  if (fsize < 8 || pread_full(f.fd, lenbuf, 8, 0) != 8)
    fail("safetensors: '" + path + "' is " + std::to_string(fsize) + " bytes, too short for the 8-byte header length");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | lenbuf[i];  // little endian
  if (hlen > kMaxHeader || hlen > fsize - 8)
    fail("safetensors: '" + path + "' declares a header of " + std::to_string(hlen) + " bytes but the file has " +
         std::to_string(fsize) + " bytes (not a safetensors file, or truncated)");
  std::string text(hlen, '\0');
  if (pread_full(f.fd, text.data(), hlen, 8) != hlen) fail("safetensors: cannot read the header of '" + path + "'");
  json h;
  try {
    h = json::parse(text);
  } catch (const json::exception& e) {
    fail("safetensors: '" + path + "': header is not valid JSON: " + e.what());
  }
  if (!h.is_object()) fail("safetensors: '" + path + "': header is not a JSON object");

  const uint64_t data_start = 8 + hlen, data_size = fsize - data_start;
  std::vector<StTensor> found;
  for (auto& [name, e] : h.items()) {
    if (name == "__metadata__") continue;
    const std::string where = "safetensors: '" + path + "': tensor '" + name + "'";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(where + ": entry needs dtype, shape and data_offsets");
    StTensor t;
    t.name = name;
    t.file = path;
    if (!e["dtype"].is_string() || !parse_dtype(e["dtype"].get<std::string>(), t.dtype))
      fail(where + ": unsupported dtype " + e["dtype"].dump() + " (supported: F32 F16 BF16 F64 I64 I32 U8 BOOL)");
    if (!e["shape"].is_array()) fail(where + ": shape is not an array");
    uint64_t numel = 1;
    for (auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(where + ": bad shape " + e["shape"].dump());
      t.shape.push_back(d.get<int64_t>());
      numel *= static_cast<uint64_t>(t.shape.back());
    }
    auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned() ||
        off[0].get<uint64_t>() > off[1].get<uint64_t>())
      fail(where + ": bad data_offsets " + off.dump());
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    t.offset = data_start + b;
    t.nbytes = en - b;
    if (t.nbytes != numel * st_dtype_size(t.dtype))
      fail(where + ": data_offsets " + off.dump() + " span " + std::to_string(t.nbytes) + " bytes but " +
           st_dtype_name(t.dtype) + " " + shape_str(t.shape) + " needs " +
           std::to_string(numel * st_dtype_size(t.dtype)));
    found.push_back(std::move(t));
  }
  // Name the first tensor (in file order) that does not fit: that is where the truncation starts.
  std::sort(found.begin(), found.end(), [](const StTensor& a, const StTensor& b) { return a.offset < b.offset; });
  for (auto& t : found) {
    if (t.offset + t.nbytes > fsize)
      fail("safetensors: '" + path + "' is truncated or corrupt: tensor '" + t.name + "' needs bytes [" +
           std::to_string(t.offset - data_start) + "," + std::to_string(t.offset - data_start + t.nbytes) +
           ") of the data section, which has " + std::to_string(data_size) + " bytes");
    if (out.count(t.name)) fail("safetensors: tensor '" + t.name + "' appears in both '" + out[t.name].file +
                                "' and '" + path + "'");
    out[t.name] = t;
  }
}

}  // namespace

size_t st_dtype_size(StDtype dt) {
  switch (dt) {
    case StDtype::F64: case StDtype::I64: return 8;
    case StDtype::F32: case StDtype::I32: return 4;
    case StDtype::F16: case StDtype::BF16: return 2;
    case StDtype::U8: case StDtype::BOOL: return 1;
  }
  return 0;
}

const char* st_dtype_name(StDtype dt) {
  switch (dt) {
    case StDtype::F32: return "F32";
    case StDtype::F16: return "F16";
    case StDtype::BF16: return "BF16";
    case StDtype::F64: return "F64";
    case StDtype::I64: return "I64";
    case StDtype::I32: return "I32";
    case StDtype::U8: return "U8";
    case StDtype::BOOL: return "BOOL";
  }
  return "?";
}

Safetensors Safetensors::open(const std::string& file_or_dir) {
  Safetensors s;
  s.source_ = file_or_dir;
  std::error_code ec;
  if (!fs::exists(file_or_dir, ec)) fail("safetensors: '" + file_or_dir + "' does not exist");
  if (!fs::is_directory(file_or_dir, ec)) {
    parse_file(file_or_dir, s.tensors_);
    return s;
  }
  const fs::path dir(file_or_dir), index = dir / "model.safetensors.index.json", single = dir / "model.safetensors";
  if (fs::exists(index)) {
    json j;
    try {
      std::ifstream in(index);
      j = json::parse(in);
    } catch (const json::exception& e) {
      fail("safetensors: '" + index.string() + "' is not valid JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail("safetensors: '" + index.string() + "' has no \"weight_map\" object");
    std::set<std::string> shards;
    for (auto& [name, shard] : j["weight_map"].items()) {
      if (!shard.is_string()) fail("safetensors: '" + index.string() + "': weight_map[\"" + name + "\"] is not a string");
      shards.insert(shard.get<std::string>());
    }
    for (auto& shard : shards) {
      const fs::path p = dir / shard;
      if (!fs::exists(p))
        fail("safetensors: '" + index.string() + "' names shard '" + shard + "', which does not exist in '" +
             dir.string() + "'");
      parse_file(p.string(), s.tensors_);
    }
    for (auto& [name, shard] : j["weight_map"].items()) {
      auto it = s.tensors_.find(name);
      if (it == s.tensors_.end() || fs::path(it->second.file).filename() != fs::path(shard.get<std::string>()).filename())
        fail("safetensors: '" + index.string() + "' maps tensor '" + name + "' to shard '" + shard.get<std::string>() +
             "', which does not contain it");
    }
    return s;
  }
  if (fs::exists(single)) {
    parse_file(single.string(), s.tensors_);
    return s;
  }
  fail("safetensors: directory '" + file_or_dir + "' has neither model.safetensors nor model.safetensors.index.json");
}

const StTensor& Safetensors::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    fail("safetensors: tensor '" + name + "' not found in '" + source_ + "' (" + std::to_string(tensors_.size()) +
         " tensors)");
  return it->second;
}

std::vector<float> Safetensors::read_f32(const std::string& name) const {
  const StTensor& t = info(name);
  std::vector<float> out(t.nbytes / std::max<size_t>(1, st_dtype_size(t.dtype)));
  read_f32_range(name, 0, int64_t(out.size()), out.data());
  return out;
}

void Safetensors::read_f32_range(const std::string& name, int64_t begin, int64_t count, float* out) const {
  const StTensor& t = info(name);
  if (t.dtype != StDtype::F32 && t.dtype != StDtype::BF16 && t.dtype != StDtype::F16 && t.dtype != StDtype::F64)
    fail("safetensors: tensor '" + name + "' in '" + t.file + "' has dtype " + st_dtype_name(t.dtype) +
         "; read_f32 reads F32, F16, BF16 and F64 only");
  const size_t es = st_dtype_size(t.dtype), numel = t.nbytes / es;
  if (begin < 0 || count < 0 || uint64_t(begin) + uint64_t(count) > numel)
    fail("safetensors: tensor '" + name + "' in '" + t.file + "': elements [" + std::to_string(begin) + "," +
         std::to_string(begin + count) + ") requested, it has " + std::to_string(numel) + " " + shape_str(t.shape));
  if (count == 0) return;
  const size_t n = size_t(count);
  const uint64_t at = t.offset + uint64_t(begin) * es;
  Fd f(::open(t.file.c_str(), O_RDONLY));
  if (f.fd < 0) fail("safetensors: cannot open '" + t.file + "' to read '" + name + "': " + std::strerror(errno));
  auto truncated = [&]() {
    fail("safetensors: '" + t.file + "' is truncated: tensor '" + name + "' (" + std::to_string(t.nbytes) +
         " bytes at offset " + std::to_string(t.offset) + ") cannot be read in full (elements [" +
         std::to_string(begin) + "," + std::to_string(begin + count) + ") wanted)");
  };
  if (t.dtype == StDtype::F32) {
    if (pread_full(f.fd, out, n * 4, at) != n * 4) truncated();
    return;
  }
  // Convert in chunks so that a large range never needs a second full-size buffer.
  constexpr size_t kChunk = 1 << 22;  // elements
  std::vector<unsigned char> buf(std::min(n, kChunk) * es);
  for (size_t i0 = 0; i0 < n; i0 += kChunk) {
    const size_t m = std::min(kChunk, n - i0), nb = m * es;
    if (pread_full(f.fd, buf.data(), nb, at + i0 * es) != nb) truncated();
    for (size_t i = 0; i < m; ++i) {
      const unsigned char* p = buf.data() + i * es;
      if (t.dtype == StDtype::F64) {
        double d;
        std::memcpy(&d, p, 8);
        out[i0 + i] = static_cast<float>(d);
      } else {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[i0 + i] = t.dtype == StDtype::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
    }
  }
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, const float*>>>& tensors,
                       StDtype dtype) {
  if (dtype != StDtype::F32 && dtype != StDtype::BF16 && dtype != StDtype::F16)
    fail(std::string("write_safetensors: '") + path + "': cannot write dtype " + st_dtype_name(dtype) +
         " from float data (use F32, BF16 or F16)");
  const size_t es = st_dtype_size(dtype);
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};  // transformers refuses files without a known format tag
  std::vector<uint64_t> numels;
  uint64_t off = 0;
  for (auto& [name, sp] : tensors) {
    if (name == "__metadata__" || h.contains(name)) fail("write_safetensors: '" + path + "': duplicate or reserved tensor name '" + name + "'");
    uint64_t numel = 1;
    for (int64_t d : sp.first) {
      if (d < 0) fail("write_safetensors: '" + path + "': tensor '" + name + "' has negative shape " + shape_str(sp.first));
      numel *= static_cast<uint64_t>(d);
    }
    if (numel > 0 && !sp.second) fail("write_safetensors: '" + path + "': tensor '" + name + "' has no data");
    h[name] = {{"dtype", st_dtype_name(dtype)}, {"shape", sp.first}, {"data_offsets", {off, off + numel * es}}};
    off += numel * es;
    numels.push_back(numel);
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data section starts 8-byte aligned

  // Write next to the target and rename, so that a crash never leaves a half-written file under the real name.
  const std::string tmp = path + ".partial";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("write_safetensors: cannot create '" + tmp + "': " + std::strerror(errno));
  bool ok = true;
  unsigned char lenbuf[8];
  for (int i = 0; i < 8; ++i) lenbuf[i] = static_cast<unsigned char>((text.size() >> (8 * i)) & 0xff);
  ok = ok && std::fwrite(lenbuf, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  std::vector<uint16_t> half;
  for (size_t k = 0; k < tensors.size() && ok; ++k) {
    const float* src = tensors[k].second.second;
    const uint64_t n = numels[k];
    if (dtype == StDtype::F32) {
      ok = n == 0 || std::fwrite(src, 4, n, f) == n;
      continue;
    }
    constexpr uint64_t kChunk = 1 << 20;
    for (uint64_t i0 = 0; i0 < n && ok; i0 += kChunk) {
      const uint64_t m = std::min(kChunk, n - i0);
      half.resize(m);
      for (uint64_t i = 0; i < m; ++i)
        half[i] = dtype == StDtype::BF16 ? f32_to_bf16(src[i0 + i]) : f32_to_f16(src[i0 + i]);
      ok = std::fwrite(half.data(), 2, m, f) == m;
    }
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    fail("write_safetensors: writing '" + tmp + "' failed: " + std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail("write_safetensors: cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
}

}  // namespace q3vl
