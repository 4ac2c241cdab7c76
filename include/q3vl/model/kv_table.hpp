// What a model step reads of the paged KV cache, and advances: each sequence's block table, length and next M-RoPE
// position. Plain data: the blocks' bookkeeping (allocation, refcounts, the prefix cache) is the serving engine's
// (serve/block_manager.hpp's KvCache), and a step only appends to blocks its sequences already hold.
#pragma once
#include <cstdint>
#include <vector>

namespace q3vl {

// vLLM's PagedAttention layout: each decoder layer's keys (after QK-norm and RoPE) and values live in one pool of
// fixed-size blocks per layer (the model's), and a sequence's tokens in the blocks its table lists, in token order.
struct KvTable {
  int64_t block = 16;                       // tokens per block
  std::vector<int64_t> len;                 // [slot] tokens cached per sequence (-1: a free slot)
  std::vector<int64_t> next_pos;            // [slot] M-RoPE position of the next token (spec 4.6 rope_deltas: max
                                            // prompt position + 1, then one more per generated token, on all rows)
  std::vector<std::vector<int32_t>> table;  // [slot] block ids, in token order

  int batch() const { return (int)len.size(); }
  int64_t blocks_for(int64_t tokens) const { return (tokens + block - 1) / block; }
  // Tokens sequence s can still append without another block.
  int64_t room(int s) const { return (int64_t)table[s].size() * block - len[s]; }
};

}  // namespace q3vl
