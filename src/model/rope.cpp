// M-RoPE position ids (spec 4.6, get_rope_index): text tokens advance all three rows together; a visual span of
// grid (t, h, w) gets (cur + t_idx, cur + br, cur + bc) over the merged grid and then cur += max(t, h/2, w/2).
// A video's temporal patches are spans of their own (visual_input).
#include <algorithm>

#include "q3vl/core/error.hpp"
#include "q3vl/model/positions.hpp"

namespace q3vl {

void vision_patch_coords(const std::vector<int64_t>& grid, int m, std::vector<int64_t>& row, std::vector<int64_t>& col) {
  row.clear();
  col.clear();
  for (size_t i = 0; i + 2 < grid.size(); i += 3) {
    const int64_t t = grid[i], h = grid[i + 1], w = grid[i + 2];
    for (int64_t tt = 0; tt < t; ++tt)
      for (int64_t br = 0; br < h / m; ++br)
        for (int64_t bc = 0; bc < w / m; ++bc)
          for (int64_t ir = 0; ir < m; ++ir)
            for (int64_t ic = 0; ic < m; ++ic) {
              row.push_back(br * m + ir);
              col.push_back(bc * m + ic);
            }
  }
}

std::vector<int64_t> vision_cu_seqlens(const std::vector<int64_t>& grid) {
  std::vector<int64_t> cu{0};
  for (size_t i = 0; i + 2 < grid.size(); i += 3)
    for (int64_t tt = 0; tt < grid[i]; ++tt) cu.push_back(cu.back() + grid[i + 1] * grid[i + 2]);
  return cu;
}


std::vector<int64_t> mrope_positions(const ModelConfig& cfg, const int64_t* ids, const std::vector<int64_t>& cu,
                                     const std::vector<int64_t>& grid) {
  const int64_t N = cu.back(), m = cfg.vision.merge, nimg = (int64_t)grid.size() / 3;
  std::vector<int64_t> pos(3 * N);
  int64_t img = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    int64_t cur = 0;
    for (int64_t i = cu[s]; i < cu[s + 1];) {
      if (!cfg.visual_token(ids[i])) {
        pos[i] = pos[N + i] = pos[2 * N + i] = cur++;
        ++i;
        continue;
      }
      if (img >= nimg)
        fail("M-RoPE: visual tokens at position " + std::to_string(i) + " but only " + std::to_string(nimg) +
             " grids were given");
      const int64_t t = grid[3 * img], mh = grid[3 * img + 1] / m, mw = grid[3 * img + 2] / m, n = t * mh * mw;
      const int64_t id = ids[i];
      if (i + n > cu[s + 1] || std::any_of(ids + i, ids + i + n, [&](int64_t v) { return v != id; }))
        fail("M-RoPE: visual span " + std::to_string(img) + " (grid " + std::to_string(t) + "x" +
             std::to_string(grid[3 * img + 1]) + "x" + std::to_string(grid[3 * img + 2]) + ") needs " +
             std::to_string(n) + " consecutive tokens " + std::to_string(id) + " at position " + std::to_string(i));
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
    fail("M-RoPE: " + std::to_string(nimg) + " grids given but " + std::to_string(img) +
         " visual spans found in input_ids");
  return pos;
}

VisualInput visual_input(const ModelConfig& cfg, const std::vector<int64_t>& ids, const std::vector<float>& pixels,
                         const std::vector<int64_t>& igrid, const std::vector<float>& vpixels,
                         const std::vector<int64_t>& vgrid) {
  const int64_t m = cfg.vision.merge, D = cfg.vision.patch_dim();
  const auto check = [&](const std::vector<int64_t>& g, size_t n_pixels, const char* what) {
    if (g.size() % 3) fail(std::string(what) + "_grid_thw must have 3 entries per row");
    int64_t rows = 0;
    for (size_t k = 0; k < g.size(); k += 3) {
      if (g[k] <= 0 || g[k + 1] <= 0 || g[k + 2] <= 0 || g[k + 1] % m || g[k + 2] % m)
        fail(std::string(what) + "_grid_thw row " + std::to_string(k / 3) +
             " is not a positive grid divisible by the merge size");
      rows += g[k] * g[k + 1] * g[k + 2];
    }
    if (size_t(rows * D) != n_pixels)
      fail(std::string(what) + "_grid_thw covers " + std::to_string(rows) + " patches, the pixels " +
           std::to_string(n_pixels / size_t(D)));
  };
  check(igrid, pixels.size(), "image");
  check(vgrid, vpixels.size(), "video");
  VisualInput out;
  out.pixels.reserve(pixels.size() + vpixels.size());
  size_t img = 0, vid = 0, vt = 0;  // next image; next video and its next temporal patch
  int64_t irow = 0, vrow = 0;       // their first pixel rows
  for (size_t i = 0; i < ids.size();) {
    const bool image = ids[i] == cfg.image_token_id;
    if (!image && ids[i] != cfg.video_token_id) {
      ++i;
      continue;
    }
    const std::vector<int64_t>& g = image ? igrid : vgrid;
    const size_t k = 3 * (image ? img : vid);
    if (k >= g.size())
      fail(std::string(image ? "image" : "video") + " tokens at position " + std::to_string(i) + " but only " +
           std::to_string(g.size() / 3) + (image ? " images" : " videos") + " were given");
    const int64_t t = image ? g[k] : 1, rows = t * g[k + 1] * g[k + 2], n = rows / (m * m);
    const size_t end = i + size_t(n);
    if (end > ids.size() || (end < ids.size() && ids[end] == ids[i]) ||
        std::any_of(ids.begin() + long(i), ids.begin() + long(end), [&](int64_t v) { return v != ids[i]; }))
      fail(std::string(image ? "image " : "video ") + std::to_string(k / 3) + " needs exactly " + std::to_string(n) +
           " placeholder tokens at position " + std::to_string(i));
    const float* src = image ? &pixels[size_t(irow * D)] : &vpixels[size_t(vrow * D)];
    out.pixels.insert(out.pixels.end(), src, src + rows * D);
    out.grid.insert(out.grid.end(), {t, g[k + 1], g[k + 2]});
    if (image) {
      irow += rows, ++img;
    } else {
      vrow += rows;
      if (++vt == size_t(g[k])) vt = 0, ++vid;
    }
    i += size_t(n);
  }
  if (3 * img != igrid.size() || 3 * vid != vgrid.size() || vt != 0)
    fail("the input ids have placeholders for " + std::to_string(img) + " image(s) and " + std::to_string(vid) +
         " whole video(s), but " + std::to_string(igrid.size() / 3) + " image(s) and " +
         std::to_string(vgrid.size() / 3) + " video(s) were given");
  return out;
}

}  // namespace q3vl
