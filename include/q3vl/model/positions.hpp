// Token and patch positions shared by every model: M-RoPE positions of a token stream, the visual spans of a batch
// in token order, and the vision tower's patch coordinates and attention segments (src/model/rope.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "q3vl/model/config.hpp"

namespace q3vl {

// ---- vision patches ----------------------------------------------------------------------------------------
// Per-patch (row, col) full-resolution coordinates in patch order (t, br, bc, ir, ic) for all images.
void vision_patch_coords(const std::vector<int64_t>& grid_thw, int merge, std::vector<int64_t>& row,
                         std::vector<int64_t>& col);
// Attention segments: one per (image, temporal group).
std::vector<int64_t> vision_cu_seqlens(const std::vector<int64_t>& grid_thw);

// ---- text positions (src/model/rope.cpp) ------------------------------------------------------------------------
// get_rope_index for a packed token stream: each segment [cu[s], cu[s+1]) is one sample starting at position 0;
// visual spans (image_token_id or video_token_id) consume grid_thw rows in order: one per span, as visual_input
// orders them (a video's temporal patches are spans of their own, grid [1, h, w]). Returns pos3 [3][N] (T, H, W).
std::vector<int64_t> mrope_positions(const ModelConfig& cfg, const int64_t* ids, const std::vector<int64_t>& cu,
                                     const std::vector<int64_t>& grid_thw);

// The images and videos of a batch as the vision tower, the embedding merge and mrope_positions take them: one grid
// per placeholder span in the order of `ids` (the token stream), the pixel rows reordered to match. A video of grid
// [T, h, w] becomes T spans of grid [1, h, w] (video_token_id), its rows split by temporal patch: what transformers
// does (get_rope_index repeats video_grid_thw to T grids of t = 1; the tower attends within each temporal patch and
// repeats the (h, w) embeddings over t), and it runs images and videos through the tower apart, which per patch row
// is the same. Fails naming the span whose tokens or grids do not match.
struct VisualInput {
  std::vector<float> pixels;
  std::vector<int64_t> grid;
};
VisualInput visual_input(const ModelConfig& cfg, const std::vector<int64_t>& ids, const std::vector<float>& pixels,
                         const std::vector<int64_t>& image_grid, const std::vector<float>& video_pixels,
                         const std::vector<int64_t>& video_grid);

}  // namespace q3vl
