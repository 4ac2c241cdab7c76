// The serving engine's block manager (as nano-vllm's and vLLM's): the paged KV cache's bookkeeping (slots, block
// tables, refcounts: KvCache; the pools themselves live in the model, which reads the block tables), the prefix cache
// over it (full blocks by a key that chains everything before them, least recently used first out), and the log of
// changes that the other ranks of a tensor-parallel or pipeline group replay before each step, so that every rank
// holds the same block ids.
#pragma once
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "q3vl/model/kv_table.hpp"
#include "q3vl/serve/generate.hpp"

namespace q3vl {

// The block tables (KvTable, what a model step reads) with their blocks' bookkeeping: a pool of max_blocks blocks
// (0: one that grows on demand, as the test reference's host pools do), handed out to sequences as they need room,
// so that sequences come and go without moving anyone's cache. Blocks are refcounted so that sequences with the same
// prompt start can share them (the prefix cache holds a reference of its own on the blocks it keeps): a block returns
// to the free list when its last holder lets go.
struct KvCache : KvTable {
  int64_t max_blocks = 0;             // pool size limit in blocks (0: none)
  std::vector<int32_t> free_blocks;
  std::vector<int32_t> refs;          // [block] holders: sequences whose table lists it, plus hold()s
  int64_t pool_blocks = 0;            // blocks handed out at least once, or the fixed pool's

  void reset();                // empties the cache (keeps block and max_blocks)
  int add();                   // a new empty sequence (a released slot is reused)
  void open(int s);            // slot s as a new empty sequence (a replica following another cache's add())
  void release(int s);         // lets go of the sequence's blocks (freed when no one else holds them) and slot
  // Starts empty sequence s with full blocks another sequence computed (its first blocks.size() * block tokens).
  void share(int s, const std::vector<int32_t>& blocks);
  void hold(int32_t b) { refs[b]++; }  // one more holder of block b
  void drop(int32_t b);                // one holder fewer: freed when none is left
  int64_t free_count() const;  // blocks that can still be handed out
  int64_t used_blocks() const { return pool_blocks - (int64_t)free_blocks.size(); }
  // Room for n more tokens of sequence s; false (nothing changed) when the pool cannot give enough blocks.
  bool reserve(int s, int64_t n);
};

// Prefix-cache keys. A token's content is its id, its three M-RoPE positions (a prefix is reused only where the new
// request computes the same positions) and, for an image's tokens, a hash of that image's pixels and grid (two images
// have the same placeholder ids); a video's tokens likewise, a hash per temporal patch of its decoded, resized and
// normalised frames (so the same clip sent again, as a data: URL or a path, shares its blocks, and another does not). A block's key chains its parent's key with its tokens' content, so it names
// everything up to and including the block. Keys are 64-bit: two different prefixes would meet with odds of about
// n^2 / 2^64 for n cached blocks, which is why the tokens themselves are not kept to compare.
uint64_t token_key(int64_t id, int64_t t, int64_t h, int64_t w);
// Every prompt token's content (pos3: the prompt's M-RoPE positions, rows t, h, w).
// Visual spans: runs of cfg's image or video placeholder, one per grid row of p (GenPrompt's order).
std::vector<uint64_t> token_keys(const GenPrompt& p, const std::vector<int64_t>& pos3, const ModelConfig& cfg);

class BlockManager {
 public:
  // `blocks` blocks of `block` tokens. replicated: other ranks follow this one (changes are logged for them,
  // take_log()).
  void reset(int64_t block, int64_t blocks, bool prefix_on, bool replicated);
  KvCache& cache() { return cache_; }
  const KvCache& cache() const { return cache_; }

  // A sequence's match in the prefix cache: the longest run of cached full blocks, short of the last prompt token
  // (its logits give the first answer token, so it is always computed).
  struct Match {
    std::vector<int32_t> blocks;
    std::vector<uint64_t> chain;  // their keys
  };
  Match match(const std::vector<uint64_t>& tkeys) const;
  // Whether `tokens` in all (a prompt and its max_tokens) fit now next to a match: cached blocks no one holds count
  // as free (they are evicted first).
  bool fits(int64_t tokens, const Match& m) const;
  // Opens a sequence for them (m shared, evicting what it must, room reserved): its slot.
  int open(int64_t tokens, const Match& m, int64_t next_pos);
  // Puts the sequence's full blocks not cached yet into the prefix cache: prompt tokens (tkeys), then generated ones
  // (out, their positions following next0 on all three rows). chain: the keys of its blocks so far, extended.
  void cache_blocks(int slot, const std::vector<uint64_t>& tkeys, const std::vector<int64_t>& out, int64_t next0,
                    std::vector<uint64_t>& chain);
  void release(int slot);
  int64_t evictable() const { return evictable_; }  // cached blocks that only the prefix cache holds
  int64_t used() const { return cache_.used_blocks() - evictable(); }
  int64_t cached() const { return (int64_t)prefix_.size(); }
  int64_t evicted() const { return evicted_; }

  // The changes since the last take, for the replicas (replicated only); apply() replays them at a replica.
  std::vector<int64_t> take_log();
  static size_t apply(KvCache& c, const std::vector<int64_t>& log, size_t i);

 private:
  void change(std::vector<int64_t> op);
  bool evict_one();
  void touch(const std::vector<uint64_t>& chain);
  int64_t idle(const std::vector<int32_t>& blocks) const;  // those of blocks the prefix cache holds alone
  void mark_cached(int32_t b, bool on);


  KvCache cache_;
  bool prefix_on_ = true, replicated_ = false;
  std::vector<int64_t> log_;
  // Full blocks by key, each holding one reference; evictable when that is the only one, least recently used first.
  struct Cached {
    int32_t block;
    uint64_t stamp;
  };
  std::unordered_map<uint64_t, Cached> prefix_;
  std::map<uint64_t, uint64_t> lru_;  // stamp -> key
  uint64_t tick_ = 0;
  int64_t evicted_ = 0;
  // evictable() kept as blocks change hands (change()), not counted over the prefix cache every step: in_prefix_
  // [block] marks the blocks prefix_ holds.
  std::vector<char> in_prefix_;
  int64_t evictable_ = 0;
};

}  // namespace q3vl
