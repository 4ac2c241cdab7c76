// KvCache (model/kv_cache.hpp): paged blocks, refcounted for the prefix cache.
#include "q3vl/model/kv_cache.hpp"

#include <algorithm>
#include <limits>

#include "q3vl/core/error.hpp"

namespace q3vl {

template <class T>
void KvCache<T>::reset(int layers, int64_t row_) {
  row = row_;
  len.clear();
  next_pos.clear();
  table.clear();
  k.assign(host_pool ? layers : 0, {});
  v.assign(host_pool ? layers : 0, {});
  free_blocks.clear();
  refs.clear();
  pool_blocks = 0;
  if (max_blocks > 0) {  // a fixed pool: allocated once, up front
    pool_blocks = max_blocks;
    refs.assign(max_blocks, 0);
    for (auto* pool : {&k, &v})
      for (auto& p : *pool) p.assign(max_blocks * block * row, T(0));
    for (int64_t b = max_blocks - 1; b >= 0; --b) free_blocks.push_back((int32_t)b);
  }
}

template <class T>
int KvCache<T>::add() {
  for (int s = 0; s < batch(); ++s)
    if (len[s] < 0) {
      len[s] = next_pos[s] = 0;
      return s;
    }
  len.push_back(0);
  next_pos.push_back(0);
  table.emplace_back();
  return batch() - 1;
}

template <class T>
void KvCache<T>::open(int s) {
  while (batch() <= s) len.push_back(-1), next_pos.push_back(0), table.emplace_back();
  if (len[s] >= 0) fail("KV cache: sequence slot " + std::to_string(s) + " is in use");
  len[s] = next_pos[s] = 0;
}

template <class T>
void KvCache<T>::release(int s) {
  for (auto it = table[s].rbegin(); it != table[s].rend(); ++it) drop(*it);
  table[s].clear();
  len[s] = -1;
}

template <class T>
void KvCache<T>::drop(int32_t b) {
  if (refs[b] <= 0) fail("KV cache: block " + std::to_string(b) + " dropped but not held");
  if (--refs[b] == 0) free_blocks.push_back(b);
}

template <class T>
void KvCache<T>::share(int s, const std::vector<int32_t>& blocks) {
  if (len[s] != 0 || !table[s].empty()) fail("KV cache: shared blocks must start sequence " + std::to_string(s));
  for (int32_t b : blocks) {
    if (b < 0 || b >= pool_blocks || refs[b] <= 0) fail("KV cache: block " + std::to_string(b) + " is not cached");
    refs[b]++;
    table[s].push_back(b);
  }
  len[s] = (int64_t)blocks.size() * block;
}

template <class T>
int64_t KvCache<T>::free_count() const {
  return max_blocks > 0 ? (int64_t)free_blocks.size() : std::numeric_limits<int64_t>::max();
}

template <class T>
bool KvCache<T>::reserve(int s, int64_t n) {
  const int64_t need = blocks_for(len[s] + n) - (int64_t)table[s].size();
  if (need <= 0) return true;
  if (need > free_count()) return false;
  for (int64_t i = 0; i < need; ++i) {
    if (free_blocks.empty()) {  // a growing pool (generate): one more block in every layer
      for (auto* pool : {&k, &v})
        for (auto& p : *pool) p.resize((pool_blocks + 1) * block * row);
      free_blocks.push_back((int32_t)pool_blocks++);
      refs.push_back(0);
    }
    refs[free_blocks.back()] = 1;
    table[s].push_back(free_blocks.back());
    free_blocks.pop_back();
  }
  return true;
}

template struct KvCache<float>;
template struct KvCache<double>;

}  // namespace q3vl
