// The paged key/value cache's bookkeeping (and, for a host pool, its storage) of generation and serving.
#pragma once
#include <cstdint>
#include <vector>

namespace q3vl {

// Generation (src/model/kv_cache.cpp): each decoder layer's keys (after QK-norm and RoPE) and values, paged: one pool
// of fixed-size blocks per layer and a block table per sequence (vLLM's PagedAttention layout), so that sequences
// of a continuously batched server come and go without moving anyone's cache. A new token only attends to what is
// cached. max_blocks = 0 lets the pool grow on demand (generate); serve fixes it from its memory budget.
// Blocks are refcounted so that sequences with the same prompt start can share them (serve's prefix cache holds a
// reference of its own on the blocks it keeps): a block returns to the free list when its last holder lets go.
template <class T> struct KvCache {
  int64_t block = 16;                       // tokens per block
  int64_t max_blocks = 0;                   // pool size limit in blocks (0: none)
  int64_t row = 0;                          // kv_heads * head_dim
  bool host_pool = true;                    // false: bookkeeping only, the pools live elsewhere (the device model)
  std::vector<int64_t> len;                 // [slot] tokens cached per sequence (-1: a free slot)
  std::vector<int64_t> next_pos;            // [slot] M-RoPE position of the next token (spec 4.6 rope_deltas: max
                                            // prompt position + 1, then one more per generated token, on all rows)
  std::vector<std::vector<int32_t>> table;  // [slot] block ids, in token order
  std::vector<std::vector<T>> k, v;         // [layer]: pool [blocks * block, row]
  std::vector<int32_t> free_blocks;
  std::vector<int32_t> refs;                // [block] holders: sequences whose table lists it, plus hold()s
  int64_t pool_blocks = 0;

  // Empties the cache for `layers` layers of `row` values per token (keeps block and max_blocks).
  void reset(int layers, int64_t row_);
  int batch() const { return (int)len.size(); }
  int add();                   // a new empty sequence (a released slot is reused)
  void open(int s);            // slot s as a new empty sequence (a replica following another cache's add())
  void release(int s);         // lets go of the sequence's blocks (freed when no one else holds them) and slot
  // Starts empty sequence s with full blocks another sequence computed (its first blocks.size() * block tokens).
  void share(int s, const std::vector<int32_t>& blocks);
  void hold(int32_t b) { refs[b]++; }  // one more holder of block b
  void drop(int32_t b);                // one holder fewer: freed when none is left
  int64_t blocks_for(int64_t tokens) const { return (tokens + block - 1) / block; }
  int64_t free_count() const;  // blocks that can still be handed out
  int64_t used_blocks() const { return pool_blocks - (int64_t)free_blocks.size(); }
  // Room for n more tokens of sequence s; false (nothing changed) when the pool cannot give enough blocks.
  bool reserve(int s, int64_t n);
  T* key(int layer, int s, int64_t pos) { return &k[layer][at(s, pos)]; }
  T* val(int layer, int s, int64_t pos) { return &v[layer][at(s, pos)]; }

 private:
  int64_t at(int s, int64_t pos) const { return ((int64_t)table[s][pos / block] * block + pos % block) * row; }
};

}  // namespace q3vl
