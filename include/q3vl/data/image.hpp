// Image decoding and Qwen3-VL image preprocessing (spec §6.1, layout §2.1).
// Matches transformers' slow (PIL) Qwen2VLImageProcessor: PIL decode and convert("RGB"), smart_resize,
// PIL bicubic resize on uint8, x/255 in double rounded to float, (x-mean)/std in float, a duplicated frame,
// and the (t, br, bc, ir, ic) x (c, tt, py, px) patch layout.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace q3vl {

// 8-bit RGB, row-major, 3 bytes per pixel (px.size() == w*h*3).
struct RgbImage {
  int w = 0, h = 0;
  std::vector<uint8_t> px;
};

// Decode a JPEG or PNG file (format told by its signature, not its name) and convert it to RGB exactly as
// PIL's Image.open(...).convert("RGB") does: alpha and tRNS are dropped (no compositing), grey is
// replicated, palettes are looked up, 16-bit colour keeps the high byte, 16-bit grey saturates at 255,
// CMYK uses PIL's formula. No EXIF rotation and no gamma handling, as in PIL.
RgbImage load_image(const std::string& path);
// scale 2, 4 or 8 (JPEG only): decoded at 1/scale of each side by libjpeg's scaled IDCT (sides rounded up), which
// never holds the full-size image: how a server reads pictures too large to decode whole. Not PIL's pixels.
RgbImage decode_image(const uint8_t* data, size_t size, const std::string& name_for_errors, int scale = 1);

// A JPEG's or PNG's size from its header, without decoding: what a server checks against its budgets first.
struct ImageHeader {
  long w = 0, h = 0;
  bool jpeg = false;  // else PNG
};
ImageHeader read_image_header(const uint8_t* data, size_t size, const std::string& name_for_errors);

// Write 8-bit RGB as a PNG file (rgb holds w*h*3 bytes).
void write_png(const std::string& path, const uint8_t* rgb, int w, int h);
inline void write_png(const std::string& path, const RgbImage& im) { write_png(path, im.px.data(), im.w, im.h); }

struct ImageConfig {
  int patch = 16;           // P
  int temporal_patch = 2;   // Tp: the single frame of an image is repeated to Tp frames
  int merge = 2;            // m: merge*merge patches make one LLM token
  long min_pixels = 65536;  // size.shortest_edge of the preprocessor config
  long max_pixels = 16777216;
  int min_side = 1;         // smallest accepted input side (transformers itself has no limit)
  float mean[3] = {0.5f, 0.5f, 0.5f};
  float std[3] = {0.5f, 0.5f, 0.5f};
  int factor() const { return patch * merge; }
};

struct ImageGrid {
  int t = 0, h = 0, w = 0;  // in patches
  long patches() const { return long(t) * h * w; }
};

// Target (height, width) as transformers' smart_resize: multiples of factor, pixel count in
// [min_pixels, max_pixels], Python's round-half-to-even. Throws if max/min side ratio > 200;
// `what` names the image in the message.
std::pair<int, int> smart_resize(int h, int w, int factor, long min_pixels, long max_pixels,
                                 const std::string& what = "image");

// PIL's Image.resize((w, h), Image.BICUBIC) on 8-bit RGB, bit for bit.
RgbImage resize_bicubic(const RgbImage& in, int w, int h);
// torch's uint8 bicubic resize with antialias (torchvision.transforms.v2.functional.resize on a uint8 tensor on the
// CPU, what transformers' video processor runs), bit for bit: int16 taps at a per-axis precision.
RgbImage resize_bicubic_aa(const RgbImage& in, int w, int h);

// The resized uint8 image the model sees (what the dataset stores); checks min_side and aspect ratio.
RgbImage resize_for_model(const RgbImage& in, const ImageConfig& cfg, const std::string& name);

// Rescale, normalise and patchify an already-resized image (sides multiples of patch*merge); appends
// grid.patches() rows of in_channels*Tp*P*P floats (3*2*16*16 = 1536) to patches_out.
ImageGrid patchify(const RgbImage& resized, const ImageConfig& cfg, std::vector<float>& patches_out);

// resize_for_model + patchify.
ImageGrid preprocess(const RgbImage& in, const ImageConfig& cfg, std::vector<float>& patches_out,
                     const std::string& name = "image");

// Number of <|image_pad|> tokens for a grid: t*h*w / merge^2 (= resized h*w/1024 for the defaults).
inline long image_tokens(const ImageGrid& g, int merge) { return g.patches() / (long(merge) * merge); }

}  // namespace q3vl
