#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "q3vl/core/error.hpp"
#include "q3vl/io/safetensors.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test (pid in the name: several ranks may run the suite at once).
fs::path tmpdir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / ("q3vl_st_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Writes a raw safetensors file with the given header text and data bytes.
void write_raw(const fs::path& p, const std::string& header, size_t data_bytes, uint64_t declared_len = 0) {
  std::ofstream o(p, std::ios::binary);
  uint64_t n = declared_len ? declared_len : header.size();
  for (int i = 0; i < 8; ++i) o.put(static_cast<char>((n >> (8 * i)) & 0xff));
  o << header << std::string(data_bytes, '\0');
}

// Runs f, expects a q3vl::Error whose message contains every needle.
template <class F>
void expect_error(F f, std::initializer_list<std::string> needles) {
  try {
    f();
    FAIL() << "no error thrown";
  } catch (const Error& e) {
    for (auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "message: " << e.what() << "\nmissing: " << n;
  }
}

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.37f * static_cast<float>(i) - 3.1f + 1e-3f * static_cast<float>(i * i);
  return v;
}

}  // namespace

TEST(Safetensors, RoundTripF32) {
  auto d = tmpdir("f32");
  auto a = ramp(24), b = ramp(5);
  write_safetensors((d / "m.safetensors").string(), {{"x.weight", {{2, 3, 4}, a.data()}}, {"y", {{5}, b.data()}}});
  auto st = Safetensors::open((d / "m.safetensors").string());
  ASSERT_EQ(st.tensors().size(), 2u);
  EXPECT_TRUE(st.has("x.weight"));
  EXPECT_FALSE(st.has("z"));
  EXPECT_EQ(st.info("x.weight").shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(st.info("x.weight").dtype, StDtype::F32);
  EXPECT_EQ(st.info("x.weight").nbytes, 96u);
  EXPECT_EQ(st.info("x.weight").offset % 8, 0u);  // header padded to 8 bytes
  EXPECT_EQ(st.read_f32("x.weight"), a);
  EXPECT_EQ(st.read_f32("y"), b);
  fs::remove_all(d);
}

TEST(Safetensors, RoundTripBF16AndF16) {
  auto d = tmpdir("half");
  auto a = ramp(100);
  a.push_back(1.0f + std::ldexp(1.0f, -8));             // bf16 tie -> even (1.0)
  a.push_back(1.0f + 3 * std::ldexp(1.0f, -8));         // bf16 tie -> even (1 + 2^-6)
  a.push_back(std::ldexp(1.0f, -20));                   // f16 subnormal
  for (StDtype dt : {StDtype::BF16, StDtype::F16}) {
    auto p = (d / "m.safetensors").string();
    write_safetensors(p, {{"w", {{static_cast<int64_t>(a.size())}, a.data()}}}, dt);
    auto st = Safetensors::open(p);
    EXPECT_EQ(st.info("w").dtype, dt);
    EXPECT_EQ(st.info("w").nbytes, a.size() * 2);
    auto r = st.read_f32("w");
    ASSERT_EQ(r.size(), a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      float expect = dt == StDtype::BF16 ? bf16_to_f32(f32_to_bf16(a[i])) : f16_to_f32(f32_to_f16(a[i]));
      EXPECT_EQ(r[i], expect) << i;
      float tol = dt == StDtype::BF16 ? std::ldexp(1.0f, -8) : std::ldexp(1.0f, -11);
      EXPECT_LE(std::fabs(r[i] - a[i]), tol * std::fabs(a[i]) + 1e-7f) << i;
    }
  }
  fs::remove_all(d);
}

TEST(Safetensors, HalfConversions) {
  // bf16 is the top half of the f32 bits; rounding is to nearest even.
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie, even stays
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(1.0f + 1.5f * std::ldexp(1.0f, -8)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                         // rounds to inf
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);     // tie, even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02); // tie, odd up
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);            // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  for (uint32_t h = 0; h < 0x7c00; ++h) EXPECT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h);
}

TEST(Safetensors, ShardedDirectory) {
  auto d = tmpdir("shard");
  auto a = ramp(6), b = ramp(4), c = ramp(3);
  write_safetensors((d / "model-00001-of-00002.safetensors").string(), {{"a", {{2, 3}, a.data()}}, {"b", {{4}, b.data()}}});
  write_safetensors((d / "model-00002-of-00002.safetensors").string(), {{"c", {{3}, c.data()}}}, StDtype::BF16);
  std::ofstream(d / "model.safetensors.index.json")
      << R"({"metadata": {"total_size": 46}, "weight_map": {"a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})";
  auto st = Safetensors::open(d.string());
  EXPECT_EQ(st.tensors().size(), 3u);
  EXPECT_EQ(st.read_f32("a"), a);
  EXPECT_EQ(st.read_f32("b"), b);
  EXPECT_EQ(st.read_f32("c").size(), 3u);
  EXPECT_NE(st.info("c").file.find("00002"), std::string::npos);
  expect_error([&] { st.info("nope"); }, {"'nope'", d.string()});

  // Index naming a shard that is not there.
  std::ofstream(d / "model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "model-00003-of-00003.safetensors"}})";
  expect_error([&] { Safetensors::open(d.string()); }, {"model-00003-of-00003.safetensors", "does not exist", "index.json"});
  // Index naming a tensor its shard does not hold.
  std::ofstream(d / "model.safetensors.index.json") << R"({"weight_map": {"q": "model-00001-of-00002.safetensors"}})";
  expect_error([&] { Safetensors::open(d.string()); }, {"'q'", "does not contain"});
  std::ofstream(d / "model.safetensors.index.json") << R"({"weight_map": )";
  expect_error([&] { Safetensors::open(d.string()); }, {"index.json", "not valid JSON"});
  fs::remove_all(d);
}

TEST(Safetensors, SingleFileDirectory) {
  auto d = tmpdir("single");
  auto a = ramp(3);
  write_safetensors((d / "model.safetensors").string(), {{"a", {{3}, a.data()}}});
  EXPECT_EQ(Safetensors::open(d.string()).read_f32("a"), a);
  fs::remove(d / "model.safetensors");
  expect_error([&] { Safetensors::open(d.string()); }, {d.string(), "neither"});
  expect_error([&] { Safetensors::open((d / "missing.safetensors").string()); }, {"missing.safetensors", "does not exist"});
  fs::remove_all(d);
}

TEST(Safetensors, HeaderErrors) {
  auto d = tmpdir("hdr");
  auto p = d / "bad.safetensors";
  const std::string ps = p.string();
  write_raw(p, "", 0);
  std::ofstream(p, std::ios::trunc) << "abc";
  expect_error([&] { Safetensors::open(ps); }, {ps, "too short"});
  write_raw(p, "{}", 0, 1000);
  expect_error([&] { Safetensors::open(ps); }, {ps, "header of 1000 bytes"});
  write_raw(p, "{\"a\": [", 0);
  expect_error([&] { Safetensors::open(ps); }, {ps, "not valid JSON"});
  write_raw(p, R"({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", 2);
  expect_error([&] { Safetensors::open(ps); }, {ps, "'a'", "unsupported dtype", "F8_E4M3"});
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 20);
  expect_error([&] { Safetensors::open(ps); }, {ps, "'a'", "[2,3]", "needs 24"});
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8);
  expect_error([&] { Safetensors::open(ps); }, {ps, "'a'", "bad data_offsets"});
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2]}})", 8);
  expect_error([&] { Safetensors::open(ps); }, {ps, "'a'", "data_offsets"});
  // Truncated: 'b' (second in the file) is the first that does not fit, even though the JSON lists 'c' first.
  write_raw(p, R"({"c": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
                   "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "BF16", "shape": [8], "data_offsets": [8, 24]}})", 12);
  expect_error([&] { Safetensors::open(ps); }, {ps, "truncated", "'b'"});
  // read_f32 of an integer tensor is refused with the tensor's name.
  write_raw(p, R"({"i": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", 8);
  expect_error([&] { Safetensors::open(ps).read_f32("i"); }, {ps, "'i'", "I64"});
  fs::remove_all(d);
}

TEST(Safetensors, TruncatedAfterOpen) {
  auto d = tmpdir("trunc");
  auto p = (d / "m.safetensors").string();
  auto a = ramp(64);
  write_safetensors(p, {{"a", {{64}, a.data()}}}, StDtype::BF16);
  auto st = Safetensors::open(p);
  fs::resize_file(p, fs::file_size(p) - 10);
  expect_error([&] { st.read_f32("a"); }, {p, "'a'", "truncated"});
  fs::remove_all(d);
}

// Ranges read only their elements, converted like read_f32 (against read_f32's slices), for every float dtype;
// requests outside the tensor and files truncated inside the range are errors naming file and tensor.
TEST(Safetensors, ReadF32Range) {
  auto d = tmpdir("range");
  auto a = ramp(37);
  for (StDtype dt : {StDtype::F32, StDtype::BF16, StDtype::F16}) {
    auto p = (d / "m.safetensors").string();
    auto b = ramp(5);
    write_safetensors(p, {{"b", {{5}, b.data()}}, {"w", {{37}, a.data()}}}, dt);
    auto st = Safetensors::open(p);
    const auto full = st.read_f32("w");
    if (dt == StDtype::BF16) {
      EXPECT_NE(full, a) << "bf16 must round some values (else this test proves little)";
    }
    for (int64_t begin : {0, 1, 16, 36, 37})
      for (int64_t count : {0, 1, 5, 20}) {
        if (begin + count > 37) continue;
        std::vector<float> got(size_t(count) + 1, -7.f);  // one guard element past the range
        st.read_f32_range("w", begin, count, got.data());
        EXPECT_EQ(std::vector<float>(got.begin(), got.end() - 1),
                  std::vector<float>(full.begin() + begin, full.begin() + begin + count))
            << st_dtype_name(dt) << " [" << begin << "," << begin + count << ")";
        EXPECT_EQ(got.back(), -7.f) << "wrote past the range";
      }
    float x;
    expect_error([&] { st.read_f32_range("w", 30, 8, &x); }, {p, "'w'", "[30,38)", "37"});
    expect_error([&] { st.read_f32_range("w", -1, 1, &x); }, {p, "'w'"});
    expect_error([&] { st.read_f32_range("nope", 0, 1, &x); }, {p, "'nope'"});
  }
  // F64 (write_safetensors writes no F64): a raw file holding 0.5 * i.
  std::vector<double> v(9);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5 * double(i) - 1.0;
  auto p64 = (d / "d.safetensors").string();
  {
    const std::string h = R"({"x":{"dtype":"F64","shape":[3,3],"data_offsets":[0,72]}})";
    write_raw(p64, h, 0);
    std::ofstream(p64, std::ios::binary | std::ios::app).write(reinterpret_cast<const char*>(v.data()), 72);
  }
  std::vector<float> got(4);
  Safetensors::open(p64).read_f32_range("x", 4, 4, got.data());
  EXPECT_EQ(got, (std::vector<float>{1.0f, 1.5f, 2.0f, 2.5f}));
  // Truncated after open: a range inside the lost bytes fails, one before them still reads.
  auto p = (d / "t.safetensors").string();
  write_safetensors(p, {{"w", {{37}, a.data()}}}, StDtype::BF16);
  auto st = Safetensors::open(p);
  fs::resize_file(p, fs::file_size(p) - 10);
  std::vector<float> r(30);
  st.read_f32_range("w", 0, 30, r.data());
  EXPECT_EQ(r[29], bf16_to_f32(f32_to_bf16(a[29])));
  expect_error([&] { st.read_f32_range("w", 30, 7, r.data()); }, {p, "'w'", "truncated"});
  fs::remove_all(d);
}
