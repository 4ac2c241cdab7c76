// Sharded start-up on 1, 2 and 4 ranks: each rank fills only its ZeRO master shard (seeded draw or HF file reads)
// and must end up with bitwise the values of the full path (every rank builds the whole model, then
// load_from_model keeps its shard), for ZeRO stages 1, 2 and 3, dense and MoE (both expert layouts), BF16 and F32.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "../hf_dir.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

const std::string kDense = "tests/data/golden/dense_tied/model/config.json";
const std::string kMoe = "tests/data/golden/moe/model/config.json";

std::vector<bool> all_trainable(const ParamTable& t) { return std::vector<bool>(t.params().size(), true); }

// `fill` fills an engine's master shards directly (after which shards_filled() is called); `full` fills a whole
// model. Compares every piece's master with the full path's, and stages 1/2's gathered weights with the full model.
template <class Sharded, class Full>
void expect_same_shards(Comm& world, const ModelConfig& cfg, int stage, Sharded fill, Full full) {
  Model ref(cfg);
  full(ref);
  const std::vector<float> want(ref.params(), ref.params() + ref.table().total());
  ZeroEngine er(ref, world, nullptr, stage, all_trainable(ref.table()));
  er.load_from_model();

  Model m(cfg, /*with_storage=*/stage != 3);
  ZeroEngine e(m, world, nullptr, stage, all_trainable(m.table()));
  fill(m.table(), e.master_slices());
  e.shards_filled();
  ASSERT_EQ(e.pieces().size(), er.pieces().size());
  for (size_t i = 0; i < e.pieces().size(); ++i) {
    const ShardPiece &a = e.pieces()[i], &b = er.pieces()[i];
    ASSERT_EQ(a.param, b.param);
    ASSERT_EQ(a.count, b.count);
    ASSERT_EQ(std::memcmp(a.master, b.master, size_t(a.count) * 4), 0)
        << "stage " << stage << ": " << m.table().param(a.param).name << " [" << a.begin << "," << a.begin + a.count
        << ")";
  }
  if (stage == 3) {
    EXPECT_EQ(m.params(), nullptr) << "stage 3 must never allocate the full weights";
    return;
  }
  e.gather_params();
  ASSERT_EQ(std::memcmp(m.params(), want.data(), want.size() * 4), 0) << "stage " << stage << " gathered weights";
}

}  // namespace

TEST(ShardedWeights, RandomInitMatchesFullInit) {
  MpiComm world(MPI_COMM_WORLD);
  for (const std::string& config : {kDense, kMoe})
    for (int stage : {1, 2, 3}) {
      SCOPED_TRACE(config);
      int64_t mine = 0, all = 0;
      expect_same_shards(
          world, load_hf_config(config), stage,
          [&](const ParamTable& t, const std::vector<ParamSlice>& s) {
            const SliceBytes b = init_random_slices(t, 5, 0.1, s);
            mine = b.mine, all = b.all;
          },
          [](Model& m) { m.init_random(5, 0.1); });
      EXPECT_EQ(int64_t(world.sum(double(mine))), all) << "each rank draws its shard only";
    }
}

TEST(ShardedWeights, HfShardsMatchFullLoad) {
  MpiComm world(MPI_COMM_WORLD);
  int pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const std::string dir = (fs::temp_directory_path() / ("q3vl_shw_" + std::to_string(pid))).string();
  struct Case { std::string config, version; StDtype dt; };
  for (const Case& c : {Case{kDense, "5.0.0", StDtype::BF16}, Case{kDense, "4.57.0", StDtype::F32},
                        Case{kMoe, "4.57.0", StDtype::BF16}, Case{kMoe, "5.2.0", StDtype::F32}}) {
    SCOPED_TRACE(c.config + " " + c.version + " " + st_dtype_name(c.dt));
    if (world.rank() == 0) test::write_hf_dir(dir, c.config, c.version, c.dt, 8);
    world.barrier();
    const ModelConfig cfg = load_hf_config(dir + "/config.json");
    for (int stage : {1, 3}) {
      int64_t mine = 0, all = 0;
      expect_same_shards(
          world, cfg, stage,
          [&](const ParamTable& t, const std::vector<ParamSlice>& s) {
            const SliceBytes b = load_hf_slices(t, dir, s);
            mine = b.mine, all = b.all;
          },
          [&](Model& m) { load_hf_weights(m, dir); });
      const int64_t read = int64_t(world.sum(double(mine)));
      if (cfg.text.num_experts > 0 && !cfg.experts_v5_layout) {
        EXPECT_GE(read, all);  // whole experts
      } else {
        EXPECT_EQ(read, all) << "each rank reads its shard only";
      }
    }
    world.barrier();
    if (world.rank() == 0) fs::remove_all(dir);
  }
  // The golden MoE checkpoint as transformers wrote it.
  const std::string golden = "tests/data/golden/moe/model";
  for (int stage : {1, 3})
    expect_same_shards(
        world, load_hf_config(golden + "/config.json"), stage,
        [&](const ParamTable& t, const std::vector<ParamSlice>& s) { load_hf_slices(t, golden, s); },
        [&](Model& m) { load_hf_weights(m, golden); });
}
