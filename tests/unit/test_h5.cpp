#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/h5.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

std::string tmpfile(const std::string& tag) {
  return (fs::temp_directory_path() / ("q3vl_h5_" + tag + "_" + std::to_string(::getpid()) + ".h5")).string();
}

}  // namespace

TEST(H5, WriteReadAllTypes) {
  const std::string p = tmpfile("types");
  const std::string grad = "grads/model.visual.blocks.0.attn.qkv.weight";  // dots are plain characters
  {
    H5File f = H5File::create(p);
    std::vector<float> a{1.5f, -2.f, 3.25f, 4.f, 5.f, 6.f};
    f.write(grad, {2, 3}, a);
    f.write<double>("d", {3}, std::vector<double>{0.1, 0.2, 0.3});
    f.write<int64_t>("batch/input_ids", {2, 2}, std::vector<int64_t>{151655, -100, 7, 1LL << 40});
    f.write<int32_t>("i32", {1}, std::vector<int32_t>{-5});
    f.write<uint8_t>("img/pixels", {2, 1, 3}, std::vector<uint8_t>{0, 1, 2, 253, 254, 255});
    f.write_scalar("loss", 2.718281828459045);
    f.write_scalar<int64_t>("step", 1200);
    f.write_string("deck", "[train]\nlr = 1e-4\n");
    f.write<float>("empty", {0, 4}, nullptr);
  }
  H5File f = H5File::open(p);
  std::vector<int64_t> shape;
  EXPECT_EQ(f.read<float>(grad, &shape), (std::vector<float>{1.5f, -2.f, 3.25f, 4.f, 5.f, 6.f}));
  EXPECT_EQ(shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.read<int64_t>("batch/input_ids"), (std::vector<int64_t>{151655, -100, 7, 1LL << 40}));
  EXPECT_EQ(f.read<int32_t>("i32"), std::vector<int32_t>{-5});
  EXPECT_EQ(f.read<uint8_t>("img/pixels", &shape)[5], 255);
  EXPECT_EQ(shape, (std::vector<int64_t>{2, 1, 3}));
  EXPECT_EQ(f.read_scalar<double>("loss"), 2.718281828459045);
  EXPECT_EQ(f.shape("loss"), std::vector<int64_t>{});
  EXPECT_EQ(f.read_scalar<int64_t>("step"), 1200);
  EXPECT_EQ(f.read_string("deck"), "[train]\nlr = 1e-4\n");
  EXPECT_TRUE(f.read<float>("empty", &shape).empty());
  EXPECT_EQ(shape, (std::vector<int64_t>{0, 4}));
  // Conversions: f64 -> f32 rounds, ints -> floats, narrower ints.
  EXPECT_EQ(f.read<float>("d")[1], 0.2f);
  EXPECT_EQ(f.read<double>("batch/input_ids")[0], 151655.0);
  EXPECT_EQ(f.read<float>("img/pixels")[4], 254.f);
  EXPECT_EQ(f.read<int64_t>("i32")[0], -5);
  EXPECT_EQ(f.read_scalar<float>("step"), 1200.f);
  expect_error([&] { f.read<int64_t>("loss"); }, {p, "'loss'", "floating-point", "i64"});
  expect_error([&] { f.read<uint8_t>("batch/input_ids"); }, {p, "'batch/input_ids'", "u8"});  // out of range
  expect_error([&] { f.read_scalar<float>(grad); }, {grad, "one value", "6"});
  fs::remove(p);
}

TEST(H5, ExistsAndList) {
  const std::string p = tmpfile("list");
  H5File f = H5File::create(p);
  float x = 1;
  f.write("grads/model.language_model.norm.weight", {1}, &x);
  f.write("grads/model.visual.merger.linear_fc1.bias", {1}, &x);
  f.write("grads/sub/deep", {1}, &x);
  f.write("logits", {1}, &x);
  EXPECT_TRUE(f.exists("grads"));
  EXPECT_TRUE(f.exists("/grads/sub"));
  EXPECT_TRUE(f.exists("grads/model.visual.merger.linear_fc1.bias"));
  EXPECT_FALSE(f.exists("grads/model.visual"));
  EXPECT_FALSE(f.exists("nope/deeper/still"));
  EXPECT_TRUE(f.is_dataset("logits"));
  EXPECT_FALSE(f.is_dataset("grads"));
  EXPECT_EQ(f.list("grads"), (std::vector<std::string>{"model.language_model.norm.weight",
                                                       "model.visual.merger.linear_fc1.bias", "sub/deep"}));
  EXPECT_EQ(f.list().size(), 4u);
  expect_error([&] { f.list("missing"); }, {p, "'missing'"});
  expect_error([&] { f.write("logits", {1}, &x); }, {p, "'logits'", "already exists"});
  fs::remove(p);
}

TEST(H5, Attributes) {
  const std::string p = tmpfile("attr");
  {
    H5File f = H5File::create(p);
    float x = 0;
    f.write("model/w", {1}, &x);
    f.set_attr("/", "format", "q3vl-checkpoint");
    f.set_attr("/", "version", int64_t{1});
    f.set_attr("/", "tokens", 1.5e9);
    f.set_attr("model/w", "note", std::string("hello"));
    f.set_attr("/", "version", int64_t{2});  // replaces
  }
  H5File f = H5File::open(p, H5File::Mode::ReadWrite);
  EXPECT_EQ(f.attr_string("/", "format"), "q3vl-checkpoint");
  EXPECT_EQ(f.attr_int("/", "version"), 2);
  EXPECT_EQ(f.attr_double("/", "tokens"), 1.5e9);
  EXPECT_EQ(f.attr_double("/", "version"), 2.0);
  EXPECT_EQ(f.attr_string("model/w", "note"), "hello");
  EXPECT_TRUE(f.has_attr("/", "format"));
  EXPECT_FALSE(f.has_attr("/", "nope"));
  EXPECT_FALSE(f.has_attr("missing", "format"));
  expect_error([&] { f.attr_int("/", "nope"); }, {p, "'nope'"});
  expect_error([&] { f.attr_int("/", "tokens"); }, {p, "'tokens'", "not an integer"});
  expect_error([&] { f.attr_string("/", "version"); }, {p, "'version'", "not a string"});
  expect_error([&] { f.attr_double("missing/obj", "x"); }, {p, "'missing/obj'"});
  fs::remove(p);
}

TEST(H5, Errors) {
  const std::string p = tmpfile("err");
  expect_error([&] { H5File::open(p); }, {p, "cannot open"});
  std::ofstream(p) << "not an hdf5 file";
  expect_error([&] { H5File::open(p); }, {p, "cannot open"});
  {
    H5File f = H5File::create(p);
    float x = 0;
    f.write("a", {1}, &x);
    expect_error([&] { f.read<float>("grads/missing.weight"); }, {p, "'grads/missing.weight'", "no such dataset"});
    expect_error([&] { f.shape("b"); }, {p, "'b'"});
    expect_error([&] { f.write("a/child", {1}, &x); }, {p, "'a/child'"});  // a parent is a dataset
  }
  {
    H5File f = H5File::open(p);  // read-only
    float x = 0;
    expect_error([&] { f.write("c", {1}, &x); }, {p, "'c'", "cannot create"});
  }
  fs::remove(p);
}
