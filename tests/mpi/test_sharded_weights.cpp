// Sharded start-up on 1, 2 and 4 ranks: each rank fills only its ZeRO master shard (seeded draw or HF file reads)
// and must end up with bitwise the values of the full path (every rank loads the whole model), dense and MoE (both
// expert layouts), BF16 and F32.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "../hf_dir.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

const std::string kDense = "tests/data/golden/dense_tied/model/config.json";
const std::string kMoe = "tests/data/golden/moe/model/config.json";

std::vector<bool> all_trainable(const ParamTable& t) { return std::vector<bool>(t.params().size(), true); }

// `fill` fills the shards' masters directly; `full` fills whole host weights. Compares every piece's master with the
// full path's elements.
template <class Sharded, class Full>
void expect_same_shards(Comm& world, const ModelConfig& cfg, Sharded fill, Full full) {
  HostWeights ref(cfg);
  full(ref);
  const ParamTable t(cfg);
  ZeroShards e(t, world, all_trainable(t));
  fill(t, e.master_slices());
  for (const ShardPiece& a : e.pieces())
    ASSERT_EQ(std::memcmp(a.master, ref.param(a.param) + a.begin, size_t(a.count) * 4), 0)
        << t.param(a.param).name << " [" << a.begin << "," << a.begin + a.count << ")";
}

}  // namespace

TEST(ShardedWeights, RandomInitMatchesFullInit) {
  MpiComm world(MPI_COMM_WORLD);
  for (const std::string& config : {kDense, kMoe}) {
    SCOPED_TRACE(config);
    int64_t mine = 0, all = 0;
    expect_same_shards(
        world, load_hf_config(config),
        [&](const ParamTable& t, const std::vector<ParamSlice>& s) {
          const SliceBytes b = init_random_slices(t, 5, 0.1, s);
          mine = b.mine, all = b.all;
        },
        [](HostWeights& m) { m.init_random(5, 0.1); });
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
    {
      int64_t mine = 0, all = 0;
      expect_same_shards(
          world, cfg,
          [&](const ParamTable& t, const std::vector<ParamSlice>& s) {
            const SliceBytes b = load_hf_slices(t, dir, s);
            mine = b.mine, all = b.all;
          },
          [&](HostWeights& m) { load_hf_weights(m, dir); });
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
  expect_same_shards(
      world, load_hf_config(golden + "/config.json"),
      [&](const ParamTable& t, const std::vector<ParamSlice>& s) { load_hf_slices(t, golden, s); },
      [&](HostWeights& m) { load_hf_weights(m, golden); });
}
