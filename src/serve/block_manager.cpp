#include "q3vl/serve/block_manager.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "q3vl/core/error.hpp"
#include "q3vl/core/hash.hpp"

namespace q3vl {

namespace {
uint64_t mix(uint64_t h, uint64_t x) { return splitmix64(h ^ splitmix64(x)); }
constexpr uint64_t kRootKey = 0x7133766c70726566ull;

uint64_t block_key(uint64_t parent, const uint64_t* tokens, int64_t n) {
  for (int64_t i = 0; i < n; ++i) parent = mix(parent, tokens[i]);
  return parent;
}

// h extended by the bits of n floats: kLanes interleaved chains, folded in order at the end. One chain of mix() is
// latency-bound at ~15 cycles a float, ~6 ms for a 448 px picture's 1.2 M floats, paid on the engine's thread at
// admission for every request; independent chains overlap.
uint64_t pixel_key(uint64_t h, const float* px, size_t n) {
  constexpr size_t kLanes = 8;
  uint64_t lane[kLanes];
  for (size_t l = 0; l < kLanes; ++l) lane[l] = mix(h, l);
  size_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    uint32_t bits[kLanes];
    std::memcpy(bits, px + k, sizeof bits);
    for (size_t l = 0; l < kLanes; ++l) lane[l] = mix(lane[l], bits[l]);
  }
  for (; k < n; ++k) {
    uint32_t bits;
    std::memcpy(&bits, px + k, 4);
    lane[0] = mix(lane[0], bits);
  }
  for (size_t l = 0; l < kLanes; ++l) h = mix(h, lane[l]);
  return mix(h, n);
}

// The changes rank 0 makes, replayed by the other ranks in the same order before the next step.
enum KvOp : int64_t { kOpen, kRelease, kShare, kReserve, kHold, kDrop };
}  // namespace

// One token's content: its id and its three M-RoPE positions (prompt tokens and generated ones alike, so that a chat
// resending an answer finds the answer's blocks).
uint64_t token_key(int64_t id, int64_t t, int64_t h, int64_t w) { return mix(mix(mix(uint64_t(id), t), h), w); }

std::vector<uint64_t> token_keys(const GenPrompt& p, const std::vector<int64_t>& pos3, const ModelConfig& cfg) {
  int64_t patches = 0;
  for (size_t g = 0; g + 2 < p.grid.size(); g += 3) patches += p.grid[g] * p.grid[g + 1] * p.grid[g + 2];
  const int64_t per = patches ? (int64_t)p.pixels.size() / patches : 0;  // floats per patch
  std::vector<uint64_t> img;
  for (size_t g = 0, off = 0; g + 2 < p.grid.size(); g += 3) {
    const uint64_t h = mix(mix(mix(kRootKey, p.grid[g]), p.grid[g + 1]), p.grid[g + 2]);
    const size_t m = (size_t)(p.grid[g] * p.grid[g + 1] * p.grid[g + 2] * per);
    const size_t a = std::min(off, p.pixels.size()), b = std::min(off + m, p.pixels.size());
    img.push_back(pixel_key(h, p.pixels.data() + a, b - a));
    off += m;
  }
  const int64_t n = (int64_t)p.ids.size();
  std::vector<uint64_t> keys(n);
  int64_t image = -1;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t x = token_key(p.ids[i], pos3[i], pos3[n + i], pos3[2 * n + i]);
    if (cfg.visual_token(p.ids[i])) {
      // A run of placeholders is one span: an image, or one temporal patch of a video (grid [1, h, w]).
      if (i == 0 || p.ids[i - 1] != p.ids[i]) ++image;
      x = mix(x, image < (int64_t)img.size() ? img[image] : 0);
    }
    keys[i] = x;
  }
  return keys;
}

void KvCache::reset() {
  len.clear(), next_pos.clear(), table.clear(), free_blocks.clear();
  refs.assign(max_blocks, 0);
  pool_blocks = max_blocks;  // a fixed pool: every block free at once
  for (int64_t b = max_blocks - 1; b >= 0; --b) free_blocks.push_back((int32_t)b);
}

int KvCache::add() {
  for (int s = 0; s < batch(); ++s)
    if (len[s] < 0) {
      len[s] = next_pos[s] = 0;
      return s;
    }
  len.push_back(0), next_pos.push_back(0), table.emplace_back();
  return batch() - 1;
}

void KvCache::open(int s) {
  while (batch() <= s) len.push_back(-1), next_pos.push_back(0), table.emplace_back();
  if (len[s] >= 0) fail("KV cache: sequence slot " + std::to_string(s) + " is in use");
  len[s] = next_pos[s] = 0;
}

void KvCache::release(int s) {
  for (auto it = table[s].rbegin(); it != table[s].rend(); ++it) drop(*it);
  table[s].clear();
  len[s] = -1;
}

void KvCache::drop(int32_t b) {
  if (refs[b] <= 0) fail("KV cache: block " + std::to_string(b) + " dropped but not held");
  if (--refs[b] == 0) free_blocks.push_back(b);
}

void KvCache::share(int s, const std::vector<int32_t>& blocks) {
  if (len[s] != 0 || !table[s].empty()) fail("KV cache: shared blocks must start sequence " + std::to_string(s));
  for (int32_t b : blocks) {
    if (b < 0 || b >= pool_blocks || refs[b] <= 0) fail("KV cache: block " + std::to_string(b) + " is not cached");
    refs[b]++;
    table[s].push_back(b);
  }
  len[s] = (int64_t)blocks.size() * block;
}

int64_t KvCache::free_count() const {
  return max_blocks > 0 ? (int64_t)free_blocks.size() : std::numeric_limits<int64_t>::max();
}

bool KvCache::reserve(int s, int64_t n) {
  const int64_t need = blocks_for(len[s] + n) - (int64_t)table[s].size();
  if (need <= 0) return true;
  if (need > free_count()) return false;
  for (int64_t i = 0; i < need; ++i) {
    if (free_blocks.empty()) free_blocks.push_back((int32_t)pool_blocks++), refs.push_back(0);  // a growing pool
    refs[free_blocks.back()] = 1;
    table[s].push_back(free_blocks.back());
    free_blocks.pop_back();
  }
  return true;
}

void BlockManager::reset(int64_t block, int64_t blocks, bool prefix_on, bool replicated) {
  cache_ = {};
  cache_.block = block;
  cache_.max_blocks = blocks;
  cache_.reset();
  prefix_on_ = prefix_on, replicated_ = replicated;
  log_.clear(), prefix_.clear(), lru_.clear();
  tick_ = 0, evicted_ = 0;
  in_prefix_.clear(), evictable_ = 0;
}

size_t BlockManager::apply(KvCache& c, const std::vector<int64_t>& o, size_t i) {
  const int s = (int)o[i + 1];
  switch (o[i]) {
    case kOpen: c.open(s), c.next_pos[s] = o[i + 2]; return i + 3;
    case kRelease: c.release(s); return i + 2;
    case kShare: c.share(s, std::vector<int32_t>(o.begin() + i + 3, o.begin() + i + 3 + o[i + 2])); return i + 3 + o[i + 2];
    case kReserve:
      if (!c.reserve(s, o[i + 2])) fail("KV cache: no room for " + std::to_string(o[i + 2]) + " tokens of sequence " +
                                        std::to_string(s));
      return i + 3;
    case kHold: c.hold(s); return i + 2;
    case kDrop: c.drop(s); return i + 2;
  }
  fail("KV cache: unknown change " + std::to_string(o[i]) + " in a step plan");
}

void BlockManager::change(std::vector<int64_t> op) {
  std::vector<int32_t> blocks;  // whose holders the change moves (a reserve's new blocks are free ones: none cached)
  switch (op[0]) {
    case kRelease: blocks = cache_.table[op[1]]; break;
    case kShare: blocks.assign(op.begin() + 3, op.end()); break;
    case kHold: case kDrop: blocks = {int32_t(op[1])}; break;
  }
  evictable_ -= idle(blocks);
  apply(cache_, op, 0);
  evictable_ += idle(blocks);
  if (replicated_) log_.insert(log_.end(), op.begin(), op.end());
}

int64_t BlockManager::idle(const std::vector<int32_t>& blocks) const {
  int64_t n = 0;
  for (int32_t b : blocks) n += size_t(b) < in_prefix_.size() && in_prefix_[size_t(b)] && cache_.refs[size_t(b)] == 1;
  return n;
}

void BlockManager::mark_cached(int32_t b, bool on) {
  if (in_prefix_.size() <= size_t(b)) in_prefix_.resize(size_t(b) + 1, 0);
  evictable_ -= idle({b});
  in_prefix_[size_t(b)] = on;
  evictable_ += idle({b});
}

std::vector<int64_t> BlockManager::take_log() { return std::exchange(log_, {}); }

// Frees the least recently used cached block no sequence holds.
bool BlockManager::evict_one() {
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    const auto c = prefix_.find(it->second);
    if (cache_.refs[c->second.block] != 1) continue;
    change({kDrop, c->second.block});
    mark_cached(c->second.block, false);
    evicted_++;
    prefix_.erase(c);
    lru_.erase(it);
    return true;
  }
  return false;
}

// Marks a sequence's cached blocks as just used, the deepest first in line for eviction: a block outlives the blocks
// after it, which are no use without it.
void BlockManager::touch(const std::vector<uint64_t>& chain) {
  for (auto k = chain.rbegin(); k != chain.rend(); ++k) {
    const auto c = prefix_.find(*k);
    if (c == prefix_.end()) continue;
    lru_.erase(c->second.stamp);
    c->second.stamp = ++tick_;
    lru_[c->second.stamp] = *k;
  }
}

BlockManager::Match BlockManager::match(const std::vector<uint64_t>& tkeys) const {
  Match m;
  const int64_t B = cache_.block, n = (int64_t)tkeys.size();
  for (int64_t b = 0; prefix_on_ && (b + 1) * B <= n - 1; ++b) {
    const uint64_t key = block_key(m.chain.empty() ? kRootKey : m.chain.back(), &tkeys[b * B], B);
    const auto it = prefix_.find(key);
    if (it == prefix_.end()) break;
    m.blocks.push_back(it->second.block);
    m.chain.push_back(key);
  }
  return m;
}

bool BlockManager::fits(int64_t tokens, const Match& m) const {
  const int64_t need = cache_.blocks_for(tokens) - (int64_t)m.blocks.size();
  int64_t hit_idle = 0;  // evictable now, but this sequence will hold them
  for (int32_t b : m.blocks) hit_idle += cache_.refs[b] == 1;
  return need <= cache_.free_count() + evictable() - hit_idle;
}

int BlockManager::open(int64_t tokens, const Match& m, int64_t next_pos) {
  int slot = 0;
  while (slot < cache_.batch() && cache_.len[slot] >= 0) ++slot;
  change({kOpen, slot, next_pos});
  if (!m.blocks.empty()) {
    std::vector<int64_t> op = {kShare, slot, (int64_t)m.blocks.size()};
    op.insert(op.end(), m.blocks.begin(), m.blocks.end());
    change(op);
    touch(m.chain);
  }
  const int64_t shared = (int64_t)m.blocks.size() * cache_.block;
  const int64_t need = cache_.blocks_for(tokens) - (int64_t)m.blocks.size();
  while (cache_.free_count() < need && evict_one()) {
  }
  change({kReserve, slot, tokens - shared});
  return slot;
}

void BlockManager::cache_blocks(int slot, const std::vector<uint64_t>& tkeys, const std::vector<int64_t>& out,
                                int64_t next0, std::vector<uint64_t>& chain) {
  if (!prefix_on_ || slot < 0) return;
  const int64_t B = cache_.block, n = (int64_t)tkeys.size(), full = cache_.len[slot] / B;
  std::vector<uint64_t> t;
  for (int64_t b = (int64_t)chain.size(); b < full; ++b) {
    t.assign(B, 0);
    for (int64_t i = b * B; i < (b + 1) * B; ++i) {
      const int64_t p = next0 + i - n;
      t[i - b * B] = i < n ? tkeys[i] : token_key(out[i - n], p, p, p);
    }
    const uint64_t key = block_key(chain.empty() ? kRootKey : chain.back(), t.data(), B);
    chain.push_back(key);
    if (prefix_.count(key)) continue;  // computed by another sequence meanwhile: keep the first
    const int32_t blk = cache_.table[slot][b];
    change({kHold, blk});
    mark_cached(blk, true);
    prefix_[key] = {blk, 0};
  }
  touch(chain);
}

void BlockManager::release(int slot) { change({kRelease, slot}); }

}  // namespace q3vl
