// The test reference's KV cache: the engine's bookkeeping (serve/block_manager.hpp's KvCache: slots, block tables,
// refcounts; default: a pool that grows on demand) with the keys and values on the host, one pool per layer.
#pragma once
#include <cstdint>
#include <vector>

#include "q3vl/serve/block_manager.hpp"

namespace q3vl {

template <class T>
struct HostKvCache : KvCache {
  int64_t row = 0;                   // kv_heads * head_dim
  std::vector<std::vector<T>> k, v;  // [layer]: pool [blocks * block, row]

  // Empties the cache for `layers` layers of `row` values per token (keeps block and max_blocks).
  void reset(int layers, int64_t row_) {
    KvCache::reset();
    row = row_;
    k.assign(layers, {}), v.assign(layers, {});
    grow();
  }
  bool reserve(int s, int64_t n) {
    if (!KvCache::reserve(s, n)) return false;
    grow();
    return true;
  }
  T* key(int layer, int s, int64_t pos) { return &k[layer][at(s, pos)]; }
  T* val(int layer, int s, int64_t pos) { return &v[layer][at(s, pos)]; }

 private:
  void grow() {  // the pools hold every block handed out
    for (auto* pool : {&k, &v})
      for (auto& p : *pool) p.resize(size_t(pool_blocks * block * row), T(0));
  }
  int64_t at(int s, int64_t pos) const { return ((int64_t)table[s][pos / block] * block + pos % block) * row; }
};

}  // namespace q3vl
