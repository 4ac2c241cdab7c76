// Tensor-parallel inference (serve/tp.hpp) at 1, 2 and 4 ranks: every rank holds its slice of the decoder and of
// the LM head's vocabulary; prompt chunks with an image and decoded tokens give the full model's logits to 1e-5
// (with 4 ranks each key/value head is replicated on two ranks), for a dense and a MoE model.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>

#include "q3vl/core/error.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/serve/tp.hpp"
#include "../unit/tiny_model.hpp"

using namespace q3vl;

namespace {
// The whole-model tests' tiny model (its MoE: one MoE and one dense layer), vocabulary 70: not a multiple of 4, so
// the last rank's vocabulary slice is shorter.
ModelConfig tp_tiny(bool moe = false) {
  ModelConfig c = test::tiny(moe, true);
  c.text.vocab = 70;
  return c;
}
}  // namespace

class ServeTp : public ::testing::TestWithParam<bool> {};

TEST_P(ServeTp, ShardedLogitsEqualTheFullModel) {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  Model full(tp_tiny(GetParam()));
  full.init_random(11, 0.3);
  Model local(tp_config(full.config(), rank, size));
  tp_shard_weights(full, local, rank, size);
  const auto [v0, v1] = tp_vocab_rows(70, rank, size);
  local.set_tensor_parallel(
      [](float* x, int64_t n) { MPI_Allreduce(MPI_IN_PLACE, x, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }, v0, v1);

  const std::vector<int64_t> ids = {7, 60, 60, 60, 8, 9};
  const std::vector<int64_t> grid = {1, 6, 2};
  std::vector<float> px;
  for (int i = 0; i < 12 * 1536; ++i) px.push_back(std::cos(0.003f * i));
  KvCache<float> cf, cl;
  std::vector<float> want = full.prefill({ids}, px, grid, cf);
  std::vector<float> got = local.prefill({ids}, px, grid, cl);
  double worst = 0;
  for (int t = 0; t < 4; ++t) {
    ASSERT_EQ((int64_t)got.size(), v1 - v0);
    for (int64_t v = v0; v < v1; ++v) worst = std::max(worst, (double)std::fabs(got[v - v0] - want[v]));
    const int64_t next = 10 + t;
    want = full.decode({0}, {next}, cf);
    got = local.decode({0}, {next}, cl);
  }
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_LT(worst, 1e-5) << size << " ranks";
  EXPECT_GT(worst + 1, 0);  // not NaN
}
INSTANTIATE_TEST_SUITE_P(DenseAndMoe, ServeTp, ::testing::Bool(),
                         [](const auto& i) { return i.param ? std::string("Moe") : std::string("Dense"); });

TEST(ServeTpSplit, RefusesWhatDoesNotSplit) {
  EXPECT_NO_THROW(tp_config(tp_tiny(true), 0, 4));
  ModelConfig m = tp_tiny(true);
  m.text.moe_intermediate = 18;  // not a multiple of 4
  EXPECT_THROW(tp_config(m, 0, 4), Error);
  ModelConfig c = tp_tiny();
  c.text.heads = 6, c.text.kv_heads = 3;
  EXPECT_THROW(tp_config(c, 0, 4), Error);
  EXPECT_NO_THROW(tp_config(tp_tiny(), 0, 4));
}
