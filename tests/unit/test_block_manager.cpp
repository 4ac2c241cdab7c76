// The serving engine's block manager (src/serve/block_manager.cpp): a second sequence with the same prompt start
// shares the first's full blocks (never the block of the last prompt token), refcounts free a block when its last
// holder lets go, cached blocks no one holds count as free and are evicted least recently used first (the deepest
// block of a chain before its parents), a full cache says no, and a replica that replays the log holds the same
// block ids; token_keys keys image and video placeholders by their spans' pixels.
#include <gtest/gtest.h>

#include "q3vl/core/error.hpp"
#include "q3vl/serve/block_manager.hpp"

using namespace q3vl;

namespace {
// Distinct token contents (what token_keys gives): prompt p's token i is base + i.
std::vector<uint64_t> keys(uint64_t base, int n) {
  std::vector<uint64_t> k(n);
  for (int i = 0; i < n; ++i) k[i] = token_key(int64_t(base + i), i, i, i);
  return k;
}
}  // namespace

TEST(BlockManager, SharesEvictsAndReplicates) {
  BlockManager bm;
  bm.reset(/*block=*/4, /*blocks=*/8, /*prefix_on=*/true, /*replicated=*/true);
  KvCache replica;
  replica.block = 4, replica.max_blocks = 8;
  replica.reset();
  auto replay = [&] {
    const std::vector<int64_t> log = bm.take_log();
    for (size_t i = 0; i < log.size();) i = BlockManager::apply(replica, log, i);
  };

  // Sequence a: 10 prompt tokens + 2 answer tokens, 3 blocks; its 2 full prompt blocks go into the prefix cache.
  const std::vector<uint64_t> ka = keys(100, 10);
  BlockManager::Match none = bm.match(ka);
  EXPECT_TRUE(none.blocks.empty());
  ASSERT_TRUE(bm.fits(12, none));
  const int a = bm.open(12, none, 10);
  bm.cache().len[a] = 10;  // the model appended the prompt
  std::vector<uint64_t> chain_a;
  bm.cache_blocks(a, ka, {}, 10, chain_a);
  EXPECT_EQ(chain_a.size(), 2u);
  EXPECT_EQ(bm.cached(), 2);
  EXPECT_EQ(bm.evictable(), 0);  // a holds them too

  // Sequence b, the same prompt: both full blocks shared (a 9-token prompt would share 2; 8 tokens only 1, since
  // the last prompt token is always computed).
  const BlockManager::Match m = bm.match(ka);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[0], bm.cache().table[a][0]);
  EXPECT_EQ(bm.match(keys(100, 8)).blocks.size(), 1u);
  const int b = bm.open(12, m, 10);
  EXPECT_NE(a, b);
  EXPECT_EQ(bm.cache().table[b][0], bm.cache().table[a][0]);
  EXPECT_EQ(bm.cache().refs[bm.cache().table[a][0]], 3);  // a, b and the prefix cache
  EXPECT_EQ(bm.used(), 4);                                // 3 of a + b's own third block

  // A prompt that fills the rest: 4 blocks free; 5 do not fit while a and b hold theirs.
  EXPECT_TRUE(bm.fits(16, bm.match(keys(500, 16))));
  EXPECT_FALSE(bm.fits(20, bm.match(keys(500, 20))));
  bm.release(a), bm.release(b);
  EXPECT_EQ(bm.evictable(), 2);  // only the prefix cache holds them now
  EXPECT_EQ(bm.used(), 0);
  EXPECT_TRUE(bm.fits(32, bm.match(keys(500, 32))));  // cached blocks count as free
  // A full cache evicts: the deepest block of the chain first.
  const int c = bm.open(28, bm.match(keys(500, 28)), 28);
  EXPECT_EQ(bm.evicted(), 1);
  EXPECT_EQ(bm.match(ka).blocks.size(), 1u);  // the first block stayed
  replay();
  EXPECT_EQ(replica.table[c], bm.cache().table[c]);
  EXPECT_EQ(replica.refs, bm.cache().refs);
  EXPECT_EQ(replica.free_blocks, bm.cache().free_blocks);
  EXPECT_THROW(BlockManager::apply(replica, {99, 0}, 0), Error);
}

TEST(BlockManager, PrefixOffSharesNothing) {
  BlockManager bm;
  bm.reset(4, 8, /*prefix_on=*/false, /*replicated=*/false);
  const std::vector<uint64_t> k = keys(7, 10);
  const int a = bm.open(12, bm.match(k), 10);
  bm.cache().len[a] = 10;
  std::vector<uint64_t> chain;
  bm.cache_blocks(a, k, {}, 10, chain);
  EXPECT_EQ(bm.cached(), 0);
  EXPECT_TRUE(bm.match(k).blocks.empty());
  EXPECT_TRUE(bm.take_log().empty());  // nobody to replay it
}

// token_keys: an image's and a video's placeholders are keyed by their span's pixels (the same ids, other pixels:
// other keys from that span on); each run of placeholders is one span (a video's temporal patch), in grid order.
TEST(BlockManager, TokenKeysFollowImageAndVideoPixels) {
  ModelConfig cfg;
  const int64_t I = cfg.image_token_id, V = cfg.video_token_id;
  // text, an image span of 2 tokens, text, two video temporal patches of 1 token each (grids [1, 1, 2] x 3 spans,
  // 2 patches of 3 floats each), text.
  GenPrompt p;
  p.ids = {1, I, I, 2, V, 3, V, 4};
  p.grid = {1, 1, 2, 1, 1, 2, 1, 1, 2};
  p.pixels.resize(3 * 2 * 3);
  for (size_t k = 0; k < p.pixels.size(); ++k) p.pixels[k] = float(k);
  const int64_t n = int64_t(p.ids.size());
  std::vector<int64_t> pos3(3 * size_t(n));
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t i = 0; i < n; ++i) pos3[size_t(r * n + i)] = i;
  const std::vector<uint64_t> base = token_keys(p, pos3, cfg);
  EXPECT_EQ(token_keys(p, pos3, cfg), base);
  // Tokens whose spans changed get other keys; the rest keep theirs.
  auto changed = [&](size_t span) {
    GenPrompt q = p;
    q.pixels[span * 6] += 1;
    const std::vector<uint64_t> k = token_keys(q, pos3, cfg);
    std::vector<int> diff;
    for (int64_t i = 0; i < n; ++i) diff.push_back(k[size_t(i)] != base[size_t(i)]);
    return diff;
  };
  EXPECT_EQ(changed(0), (std::vector<int>{0, 1, 1, 0, 0, 0, 0, 0}));  // the image
  EXPECT_EQ(changed(1), (std::vector<int>{0, 0, 0, 0, 1, 0, 0, 0}));  // the video's first temporal patch
  EXPECT_EQ(changed(2), (std::vector<int>{0, 0, 0, 0, 0, 0, 1, 0}));  // its second
}
