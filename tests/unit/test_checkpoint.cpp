// Single-process parts of the checkpoint code: the flat-range -> hyperslab decomposition (checked element by
// element against brute force), 64-bit ranges, the split-independent checksum, and h5py reading a file.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "q3vl/core/error.hpp"
#include "q3vl/io/checkpoint.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

// Flat indices of a box's elements in row-major order.
std::vector<int64_t> box_elements(const std::vector<int64_t>& shape, const CkptBox& b) {
  std::vector<int64_t> out;
  size_t nd = shape.size();
  if (nd == 0) return {0};
  std::vector<int64_t> idx(nd, 0);
  int64_t total = 1;
  for (auto c : b.count) total *= c;
  for (int64_t k = 0; k < total; ++k) {
    int64_t flat = 0;
    for (size_t d = 0; d < nd; ++d) flat = flat * shape[d] + b.start[d] + idx[d];
    out.push_back(flat);
    for (size_t d = nd; d-- > 0;) {  // odometer
      if (++idx[d] < b.count[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

}  // namespace

TEST(CheckpointBoxes, EveryRangeOfSmallShapesExactly) {
  const std::vector<std::vector<int64_t>> shapes{{}, {1}, {7}, {3, 4}, {1, 5}, {2, 3, 4}, {2, 1, 3, 2}, {3, 1, 1}};
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    for (int64_t b = 0; b <= n; ++b)
      for (int64_t c = 0; b + c <= n; ++c) {
        auto boxes = flat_range_boxes(shape, b, c);
        std::vector<int64_t> got;
        for (const auto& box : boxes) {
          ASSERT_EQ(box.start.size(), shape.size());
          ASSERT_EQ(box.count.size(), shape.size());
          for (size_t d = 0; d < shape.size(); ++d) {
            ASSERT_GE(box.count[d], 1);
            ASSERT_LE(box.start[d] + box.count[d], shape[d]);
          }
          for (auto e : box_elements(shape, box)) got.push_back(e);
        }
        std::vector<int64_t> want;
        for (int64_t i = b; i < b + c; ++i) want.push_back(i);
        ASSERT_EQ(got, want) << "shape rank " << shape.size() << " range " << b << "+" << c;
        if (!shape.empty()) {
          ASSERT_LE(boxes.size(), 2 * shape.size() - 1);
        }
      }
  }
}

TEST(CheckpointBoxes, RangesBeyond32Bits) {
  // 10^10 elements; a slice of 5*10^9 starting mid-row: leading partial row, block, trailing partial row.
  const std::vector<int64_t> shape{100000, 100000};
  const int64_t b = 3000000007LL, c = 5000000000LL;
  auto boxes = flat_range_boxes(shape, b, c);
  ASSERT_EQ(boxes.size(), 3u);
  EXPECT_EQ(boxes[0].start, (std::vector<int64_t>{30000, 7}));
  EXPECT_EQ(boxes[0].count, (std::vector<int64_t>{1, 99993}));
  EXPECT_EQ(boxes[1].start, (std::vector<int64_t>{30001, 0}));
  EXPECT_EQ(boxes[1].count, (std::vector<int64_t>{49999, 100000}));
  EXPECT_EQ(boxes[2].start, (std::vector<int64_t>{80000, 0}));
  EXPECT_EQ(boxes[2].count, (std::vector<int64_t>{1, 7}));
  int64_t sum = 0;
  for (auto& box : boxes) sum += box.count[0] * box.count[1];
  EXPECT_EQ(sum, c);
}

TEST(CheckpointBoxes, BadRangeIsRefused) {
  try {
    flat_range_boxes({3, 4}, 10, 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit shape [3, 4]"), std::string::npos) << e.what();
  }
}

TEST(CheckpointChecksum, SplitIndependentAndPositionSensitive) {
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 17) * 0.25f - 1.0f;
  uint64_t whole = ckpt_checksum(v.data(), 0, 1000);
  EXPECT_EQ(ckpt_checksum(v.data(), 0, 333) + ckpt_checksum(v.data() + 333, 333, 667), whole);
  std::vector<float> w = v;
  std::swap(w[10], w[11]);  // same values, different places
  ASSERT_NE(w[10], w[11]);
  EXPECT_NE(ckpt_checksum(w.data(), 0, 1000), whole);
  w = v;
  ASSERT_EQ(v[497], 0.0f);
  w[497] = -0.0f;  // one bit from +0
  EXPECT_NE(ckpt_checksum(w.data(), 0, 1000), whole);
}

// h5py (the reader tools/ uses) reads every attribute and dataset. Skipped where h5py is not installed.
TEST(CheckpointH5py, ReadsEverything) {
  const char* py = "/usr/bin/python3";
  if (std::system((std::string(py) + " -c 'import h5py' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "python3-h5py not installed";
  std::string dir = (fs::temp_directory_path() / ("q3vl_ckpt_py_" + std::to_string(::getpid()))).string();
  std::vector<float> a(2 * 3 * 4), s{2.5f};
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * float(i) - 3.0f;
  std::vector<CkptSlice> slices{{"model/x.weight", {2, 3, 4}, 0, 24, a.data()},
                                {"optim/exp_avg_sq/x.weight", {}, 0, 1, s.data()}};
  CkptMeta m{12, 34567, 0, "[train]\nlr = 3e-4 # ✓ ünïcode\n", "{\"cursor\": 9}",
             "q3vl 0.1 abc", "{\"depth\": 2}\n"};
  std::string path = write_checkpoint(dir, MPI_COMM_WORLD, m, slices, 1);
  std::string script = dir + "/check.py";
  std::ofstream(script) << R"(import sys, h5py, numpy as np
f = h5py.File(sys.argv[1], "r")
a = f.attrs
assert a["format"] == "q3vl-checkpoint", a["format"]
assert a["format_version"] == 1 and a["step"] == 12 and a["tokens_seen"] == 34567 and a["world_size"] == 1
assert a["deck"] == "[train]\nlr = 3e-4 # \u2713 \u00fcn\u00efcode\n", repr(a["deck"])
assert a["state_json"] == '{"cursor": 9}' and a["build"] == "q3vl 0.1 abc"
assert a["hf_config_json"] == '{"depth": 2}\n', repr(a["hf_config_json"])
x = f["model/x.weight"]
assert x.dtype == np.float32 and x.shape == (2, 3, 4)
assert np.array_equal(x[()], (0.5 * np.arange(24) - 3).reshape(2, 3, 4).astype(np.float32))
assert f["optim/exp_avg_sq/x.weight"][()] == np.float32(2.5)
print("h5py ok")
)";
  int rc = std::system((std::string(py) + " " + script + " " + path).c_str());
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0) << "h5py could not read " << path;
}
