// The tensor-core GEMV's index mapping (src/tensor/cuda/gemv_tc_map.hpp, the functions the kernel uses), checked on
// the CPU: the physical columns of a warp step are a bijection, A and B agree on every mma's logical k, and an
// emulation of the kernel's register assembly through the PTX fragment layouts computes the plain dot products.
// Runs without a GPU (named BackendOps.* to run with the op table's filter).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "q3vl/core/dtype.hpp"
#include "tensor/cuda/gemv_tc_map.hpp"

using namespace q3vl;
namespace w = q3vl::dev::cuda::wgemv;

namespace {

// G: elements of a lane's 16-byte group (16 for 8-bit weights, 8 for 16-bit); a step is 4 G columns, G / 4 mmas.
void check_bijection(int G) {
  std::vector<int> hits(size_t(4 * G), 0);
  for (int t = 0; t < 4; ++t)
    for (int m = 0; m < G / 4; ++m)
      for (int p = 0; p < 2; ++p)
        for (int h = 0; h < 2; ++h) {
          const int c = w::tc_col(G, t, m, p, h);
          ASSERT_GE(c, 0);
          ASSERT_LT(c, 4 * G);
          hits[size_t(c)]++;
          // the element lies in lane t's own group (what it loaded)
          EXPECT_EQ(c / G, t);
        }
  for (int c = 0; c < 4 * G; ++c) EXPECT_EQ(hits[size_t(c)], 1) << "G " << G << " column " << c;
}

// Within each mma, A (both rows of a lane) and B map logical k to the same physical column, for every lane.
void check_a_b_agree(int G) {
  for (int m = 0; m < G / 4; ++m) {
    std::vector<int> col_of_k(16, -1);
    auto see = [&](int k, int c) {
      ASSERT_GE(k, 0);
      ASSERT_LT(k, 16);
      if (col_of_k[size_t(k)] < 0) col_of_k[size_t(k)] = c;
      EXPECT_EQ(col_of_k[size_t(k)], c) << "G " << G << " mma " << m << " k " << k;
    };
    for (int lane = 0; lane < 32; ++lane)
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < 4; ++r) see(w::frag_a_k(lane, r, h), w::tc_col(G, lane, m, r >> 1, h));
        for (int r = 0; r < 2; ++r) see(w::frag_b_k(lane, r, h), w::tc_col(G, lane, m, r, h));
      }
    for (int k = 0; k < 16; ++k) EXPECT_GE(col_of_k[size_t(k)], 0) << "mma " << m << " k " << k << " unused";
  }
}

// The kernel's step, emulated: each lane's two loaded groups (rows g, g + 8: elements t G .. t G + G - 1 of the
// step) and its x row's G values feed A regs (w[r & 1], pair r >> 1) and B regs (pair r) as tc_step/a_reg do; the
// mma is applied to the logical matrices the PTX layout assembles; the C fragments must hold the dot products over
// the step's 4 G columns.
void check_emulated_step(int G) {
  std::mt19937 gen{static_cast<uint32_t>(G)};
  std::uniform_int_distribution<int> d(-9, 9);
  const int C = 4 * G;
  std::vector<double> W(size_t(16 * C)), X(size_t(8 * C));
  for (auto& v : W) v = d(gen);
  for (auto& v : X) v = d(gen);
  std::vector<double> acc(size_t(16 * 8), 0.0);  // [row][n], summed over the step's mmas
  for (int m = 0; m < G / 4; ++m) {
    double A[16][16], B[16][8];
    bool setA[16][16] = {}, setB[16][8] = {};
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) {
          const int row = g + 8 * (r & 1);  // the group the kernel takes reg r from
          const double v = W[size_t(row * C + t * G + w::tc_pair(m, r >> 1) + h)];
          const int lr = w::frag_a_row(lane, r), lk = w::frag_a_k(lane, r, h);
          ASSERT_FALSE(setA[lr][lk]);
          setA[lr][lk] = true, A[lr][lk] = v;
        }
      for (int r = 0; r < 2; ++r)
        for (int h = 0; h < 2; ++h) {
          const double v = X[size_t(g * C + t * G + w::tc_pair(m, r) + h)];
          const int lk = w::frag_b_k(lane, r, h), ln = w::frag_b_n(lane);
          ASSERT_FALSE(setB[lk][ln]);
          setB[lk][ln] = true, B[lk][ln] = v;
        }
    }
    for (int i = 0; i < 16; ++i)
      for (int n = 0; n < 8; ++n) {
        double s = 0;
        for (int k = 0; k < 16; ++k) s += A[i][k] * B[k][n];
        acc[size_t(i * 8 + n)] += s;
      }
  }
  // Read back through the C layout, as tc_rows' epilogue does, against the direct sums.
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int row = w::frag_c_row(lane, i), n = w::frag_c_n(lane, i);
      double want = 0;
      for (int c = 0; c < C; ++c) want += W[size_t(row * C + c)] * X[size_t(n * C + c)];
      EXPECT_EQ(acc[size_t(row * 8 + n)], want) << "G " << G << " row " << row << " n " << n;
    }
}

// __byte_perm(x, y, s) on the host: result byte i is byte (s >> 4 i) & 7 of {y:x}.
uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

}  // namespace

TEST(BackendOps, GemvTcMapIsBijection) {
  check_bijection(16);
  check_bijection(8);
}
TEST(BackendOps, GemvTcMapAgreesForAB) {
  check_a_b_agree(16);
  check_a_b_agree(8);
}
TEST(BackendOps, GemvTcMapEmulatedStep) {
  check_emulated_step(16);
  check_emulated_step(8);
}
// int8 -> f16 as a_reg does it: the bytes (xor 0x80) as the low bytes of 0x64xx halves, minus 1152: exact, low
// half the lower column.
TEST(BackendOps, GemvTcInt8ToHalf) {
  for (int b0 = -128; b0 < 128; ++b0)
    for (int b1 : {-128, -1, 0, 1, 77, 127}) {
      const uint32_t w = uint32_t(uint8_t(b0)) | uint32_t(uint8_t(b1)) << 8 | uint32_t(uint8_t(b1)) << 16 |
                         uint32_t(uint8_t(b0)) << 24;
      for (int hi = 0; hi < 2; ++hi) {
        const uint32_t h2 = byte_perm(w ^ 0x80808080u, 0x64646464u, hi ? 0x4342u : 0x4140u);
        const float lo = f16_to_f32(uint16_t(h2 & 0xffff)) - 1152.f, up = f16_to_f32(uint16_t(h2 >> 16)) - 1152.f;
        EXPECT_EQ(lo, float(hi ? b1 : b0));
        EXPECT_EQ(up, float(hi ? b0 : b1));
      }
    }
}
// The TMA GEMV's panels: over its two steps a lane's chunks cover each row's eight 16-byte chunks once (lanes of
// one g together), the swizzled offsets are a bijection onto the panel's 2 KiB, and each quarter-warp's 16-byte
// loads (rows g and g + 1, then g + 8 and g + 9) hit eight distinct bank groups.
TEST(BackendOps, GemvTmaPanelMap) {
  std::vector<int> slot(128, 0);
  for (int row = 0; row < 16; ++row)
    for (int c = 0; c < 8; ++c) {
      const int off = w::tma_offset(row, c);
      ASSERT_EQ(off % 16, 0);
      ASSERT_GE(off, 0);
      ASSERT_LT(off, 2048);
      slot[size_t(off / 16)]++;
    }
  for (int i = 0; i < 128; ++i) EXPECT_EQ(slot[size_t(i)], 1) << "16-byte slot " << i;
  for (int g = 0; g < 8; ++g) {
    std::vector<int> chunks(8, 0);
    for (int t = 0; t < 4; ++t)
      for (int s = 0; s < 2; ++s) chunks[size_t(w::tma_chunk(4 * g + t, s))]++;
    for (int c = 0; c < 8; ++c) EXPECT_EQ(chunks[size_t(c)], 1) << "row " << g << " chunk " << c;
  }
  for (int s = 0; s < 2; ++s)
    for (int half = 0; half < 2; ++half)  // the load of rows g, then of rows g + 8
      for (int q = 0; q < 4; ++q) {
        std::vector<int> bank(8, 0);
        for (int lane = 8 * q; lane < 8 * q + 8; ++lane)
          bank[size_t(w::tma_offset(lane / 4 + 8 * half, w::tma_chunk(lane, s)) / 16 % 8)]++;
        for (int b = 0; b < 8; ++b) EXPECT_EQ(bank[size_t(b)], 1) << "step " << s << " quarter " << q;
      }
}
// The TMA GEMV's schedule: over the blocks of a grid, every (item, stage) is issued exactly once, and a block's
// consumers (items b, b + grid, ..., spt stages each) meet its stages in the producer's order; blocks past the items
// (experts with fewer rows than the grid was sized for) have none.
TEST(BackendOps, GemvTmaSchedule) {
  for (int64_t items : {1, 7, 96, 256, 384, 1000})
    for (int64_t spt : {1, 2, 4, 9})
      for (int64_t grid : {1, 5, 132}) {
        std::vector<int> seen(size_t(items * spt), 0);
        for (int64_t b = 0; b < grid; ++b) {
          const int64_t n = w::tma_block_stages(items, spt, b, grid);
          for (int64_t i = 0; i < n; ++i) {
            const int64_t it = w::tma_stage_item(i, spt, b, grid);
            ASSERT_LT(it, items);
            EXPECT_EQ(it % grid, b);
            seen[size_t(it * spt + i % spt)]++;
          }
          int64_t i = 0;  // the consumers' loop
          for (int64_t it = b; it < items; it += grid)
            for (int64_t kp = 0; kp < spt; ++kp, ++i) {
              EXPECT_EQ(w::tma_stage_item(i, spt, b, grid), it);
              EXPECT_EQ(i % spt, kp);
            }
          EXPECT_EQ(i, n);
        }
        for (int64_t k = 0; k < items * spt; ++k)
          EXPECT_EQ(seen[size_t(k)], 1) << items << " items, " << spt << " stages, grid " << grid;
      }
}
