// M-RoPE position ids (spec 4.6, get_rope_index): text tokens advance all three rows together; an image span of
// grid (t, h, w) gets (cur + t_idx, cur + br, cur + bc) over the merged grid and then cur += max(t, h/2, w/2).
#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/model/layers.hpp"

namespace q3vl {

std::vector<int64_t> mrope_positions(const ModelConfig& cfg, const int64_t* ids, const std::vector<int64_t>& cu,
                                     const std::vector<int64_t>& grid) {
  const int64_t N = cu.back(), m = cfg.vision.merge, nimg = (int64_t)grid.size() / 3;
  std::vector<int64_t> pos(3 * N);
  int64_t img = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    int64_t cur = 0;
    for (int64_t i = cu[s]; i < cu[s + 1];) {
      if (ids[i] != cfg.image_token_id) {
        pos[i] = pos[N + i] = pos[2 * N + i] = cur++;
        ++i;
        continue;
      }
      if (img >= nimg)
        fail("M-RoPE: image tokens at position " + std::to_string(i) + " but only " + std::to_string(nimg) +
             " image grids were given");
      const int64_t t = grid[3 * img], mh = grid[3 * img + 1] / m, mw = grid[3 * img + 2] / m, n = t * mh * mw;
      if (i + n > cu[s + 1] || std::any_of(ids + i, ids + i + n, [&](int64_t v) { return v != cfg.image_token_id; }))
        fail("M-RoPE: image " + std::to_string(img) + " (grid " + std::to_string(t) + "x" +
             std::to_string(grid[3 * img + 1]) + "x" + std::to_string(grid[3 * img + 2]) + ") needs " +
             std::to_string(n) + " consecutive image tokens at position " + std::to_string(i));
      for (int64_t tt = 0; tt < t; ++tt)
        for (int64_t br = 0; br < mh; ++br)
          for (int64_t bc = 0; bc < mw; ++bc, ++i) {
            pos[i] = cur + tt;
            pos[N + i] = cur + br;
            pos[2 * N + i] = cur + bc;
          }
      cur += std::max({t, mh, mw});
      ++img;
    }
  }
  if (img != nimg)
    fail("M-RoPE: " + std::to_string(nimg) + " image grids given but " + std::to_string(img) +
         " image spans found in input_ids");
  return pos;
}

}  // namespace q3vl
