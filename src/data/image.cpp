#include "q3vl/data/image.hpp"

#include <png.h>

#include <cstdio>  // before jpeglib.h, which uses FILE
#include <jpeglib.h>
#include <jerror.h>  // after jpeglib.h: message codes

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstring>
#include <fstream>
#include <iterator>

#include "q3vl/core/error.hpp"

namespace q3vl {
namespace {

// PIL refuses images above twice Image.MAX_IMAGE_PIXELS (DecompressionBombError); so do we, before
// allocating anything.
constexpr long kMaxDecodePixels = 2L * 89478485;

void check_dims(long w, long h, const std::string& name) {
  if (w <= 0 || h <= 0) fail(name + ": image has no pixels (" + std::to_string(w) + "x" + std::to_string(h) + ")");
  if (w * h > kMaxDecodePixels)
    fail(name + ": image is " + std::to_string(w) + "x" + std::to_string(h) + ", more than " +
         std::to_string(kMaxDecodePixels) + " pixels (decompression bomb?)");
}

// ---- PNG -------------------------------------------------------------------------------------------------
// libpng reports errors by longjmp. Each phase that may longjmp runs in a function that owns no C++ object
// with a destructor; buffers are allocated by the caller between phases.

struct PngRead {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0, pos = 0;
  char err[256] = {0};
  png_uint_32 w = 0, h = 0;
  int bit_depth = 0, color_type = 0, channels = 0;
  size_t rowbytes = 0;
};

void png_on_error(png_structp png, png_const_charp msg) {
  auto* r = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(r->err, sizeof r->err, "%s", msg);
  png_longjmp(png, 1);
}
void png_on_warning(png_structp, png_const_charp) {}

void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  auto* r = static_cast<PngRead*>(png_get_io_ptr(png));
  if (n > r->size - r->pos) png_error(png, "file is truncated");
  std::memcpy(out, r->data + r->pos, n);
  r->pos += n;
}

bool png_read_header(PngRead* r) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_set_read_fn(r->png, r, png_read_mem);
  png_read_info(r->png, r->info);
  int interlace = 0;
  png_get_IHDR(r->png, r->info, &r->w, &r->h, &r->bit_depth, &r->color_type, &interlace, nullptr, nullptr);
  // PIL: 1/2/4-bit grey scales to 0..255, palettes are looked up, 16-bit colour keeps the high byte.
  // 16-bit grey stays 16-bit here and saturates later, as PIL's I;16 -> RGB does. tRNS is ignored.
  if (r->color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(r->png);
  if (r->color_type == PNG_COLOR_TYPE_GRAY && r->bit_depth < 8) png_set_expand_gray_1_2_4_to_8(r->png);
  if (r->bit_depth == 16 && r->color_type != PNG_COLOR_TYPE_GRAY) png_set_strip_16(r->png);
  png_set_interlace_handling(r->png);
  png_read_update_info(r->png, r->info);
  r->channels = png_get_channels(r->png, r->info);
  r->rowbytes = png_get_rowbytes(r->png, r->info);
  return true;
}

bool png_read_pixels(PngRead* r, png_bytep* rows) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_read_image(r->png, rows);
  png_read_end(r->png, nullptr);
  return true;
}

RgbImage decode_png(const uint8_t* data, size_t size, const std::string& name) {
  PngRead r;
  r.data = data;
  r.size = size;
  r.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, png_on_error, png_on_warning);
  if (r.png) r.info = png_create_info_struct(r.png);
  if (!r.png || !r.info) {
    png_destroy_read_struct(&r.png, &r.info, nullptr);
    fail(name + ": cannot initialise libpng");
  }
  std::vector<uint8_t> buf;
  std::vector<png_bytep> rows;
  bool ok = png_read_header(&r);
  if (ok && (long(r.w) <= 0 || long(r.h) <= 0 || long(r.w) * long(r.h) > kMaxDecodePixels)) {
    png_destroy_read_struct(&r.png, &r.info, nullptr);
    check_dims(r.w, r.h, name);
  }
  if (ok) {
    buf.resize(r.rowbytes * r.h);
    rows.resize(r.h);
    for (png_uint_32 y = 0; y < r.h; ++y) rows[y] = buf.data() + y * r.rowbytes;
    ok = png_read_pixels(&r, rows.data());
  }
  png_destroy_read_struct(&r.png, &r.info, nullptr);
  if (!ok) fail(name + ": corrupt or truncated PNG file: " + r.err);

  RgbImage im;
  im.w = int(r.w);
  im.h = int(r.h);
  im.px.resize(size_t(im.w) * im.h * 3);
  const bool grey16 = r.bit_depth == 16 && r.color_type == PNG_COLOR_TYPE_GRAY;
  const int ch = r.channels;
  for (int y = 0; y < im.h; ++y) {
    const uint8_t* in = rows[y];
    uint8_t* out = &im.px[size_t(y) * im.w * 3];
    for (int x = 0; x < im.w; ++x, out += 3) {
      if (grey16) {  // big-endian sample, clipped to 255
        const uint8_t v = in[2 * x] ? 255 : in[2 * x + 1];
        out[0] = out[1] = out[2] = v;
      } else if (ch <= 2) {  // grey or grey+alpha: replicate, drop alpha
        out[0] = out[1] = out[2] = in[x * ch];
      } else {  // RGB or RGBA: drop alpha
        std::memcpy(out, in + x * ch, 3);
      }
    }
  }
  return im;
}

// ---- JPEG ------------------------------------------------------------------------------------------------

struct JpegErr {
  jpeg_error_mgr mgr;
  jmp_buf jb;
  char msg[JMSG_LENGTH_MAX];
};

void jpeg_on_error(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErr*>(cinfo->err);
  cinfo->err->format_message(cinfo, e->msg);
  longjmp(e->jb, 1);
}

// libjpeg pads a truncated stream with grey and only warns; PIL refuses it ("image file is truncated").
void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_on_error(cinfo);
}

struct JpegRead {
  jpeg_decompress_struct cinfo;
  JpegErr err;
};

bool jpeg_read_header_phase(JpegRead* j, const uint8_t* data, size_t size) {
  if (setjmp(j->err.jb)) return false;
  jpeg_mem_src(&j->cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&j->cinfo, TRUE);
  // PIL's modes: 1 component -> L, 3 -> RGB (libjpeg converts YCbCr), 4 -> CMYK.
  switch (j->cinfo.num_components) {
    case 1: j->cinfo.out_color_space = JCS_GRAYSCALE; break;
    case 3: j->cinfo.out_color_space = JCS_RGB; break;
    case 4: j->cinfo.out_color_space = JCS_CMYK; break;
    default: std::snprintf(j->err.msg, sizeof j->err.msg, "%d colour components", j->cinfo.num_components);
             return false;
  }
  return true;
}

bool jpeg_start_phase(JpegRead* j) {
  if (setjmp(j->err.jb)) return false;
  jpeg_start_decompress(&j->cinfo);
  return true;
}

bool jpeg_pixels_phase(JpegRead* j, uint8_t* buf, size_t stride) {
  if (setjmp(j->err.jb)) return false;
  while (j->cinfo.output_scanline < j->cinfo.output_height) {
    JSAMPROW row = buf + size_t(j->cinfo.output_scanline) * stride;
    jpeg_read_scanlines(&j->cinfo, &row, 1);
  }
  jpeg_finish_decompress(&j->cinfo);
  return true;
}

void jpeg_init(JpegRead& j) {
  j.cinfo.err = jpeg_std_error(&j.err.mgr);
  j.err.mgr.error_exit = jpeg_on_error;
  j.err.mgr.emit_message = jpeg_on_message;
  j.err.msg[0] = 0;
  jpeg_create_decompress(&j.cinfo);
}

RgbImage decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int scale) {
  JpegRead j;
  jpeg_init(j);
  bool ok = jpeg_read_header_phase(&j, data, size);
  if (ok) {
    j.cinfo.scale_num = 1, j.cinfo.scale_denom = unsigned(scale);  // the IDCT at 1/scale: no full-size buffer
    const long w = (j.cinfo.image_width + scale - 1) / scale, h = (j.cinfo.image_height + scale - 1) / scale;
    if (w <= 0 || h <= 0 || w * h > kMaxDecodePixels) {
      jpeg_destroy_decompress(&j.cinfo);
      check_dims(w, h, name);
    }
    ok = jpeg_start_phase(&j);
  }
  std::vector<uint8_t> buf;
  if (ok) {
    buf.resize(size_t(j.cinfo.output_width) * j.cinfo.output_height * j.cinfo.output_components);
    ok = jpeg_pixels_phase(&j, buf.data(), size_t(j.cinfo.output_width) * j.cinfo.output_components);
  }
  const int ch = j.cinfo.output_components;
  RgbImage im;
  im.w = int(j.cinfo.output_width);
  im.h = int(j.cinfo.output_height);
  jpeg_destroy_decompress(&j.cinfo);
  if (!ok) fail(name + ": corrupt or truncated JPEG file: " + j.err.msg);

  const size_t n = size_t(im.w) * im.h;
  im.px.resize(n * 3);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* out = &im.px[i * 3];
    if (ch == 1) {
      out[0] = out[1] = out[2] = buf[i];
    } else if (ch == 3) {
      std::memcpy(out, &buf[i * 3], 3);
    } else {
      // PIL reads every 4-component JPEG as inverted (Adobe) CMYK, then cmyk2rgb:
      // out = nk - nk*c/255 in its fixed-point MULDIV255, with nk = 255 - k.
      const uint8_t* in = &buf[i * 4];
      const int nk = in[3];  // 255 - (255 - raw k)
      for (int c = 0; c < 3; ++c) {
        const int t = (255 - in[c]) * nk + 128;
        out[c] = uint8_t(std::clamp(nk - (((t >> 8) + t) >> 8), 0, 255));
      }
    }
  }
  return im;
}

// ---- Bicubic resampling: PIL's (Pillow src/libImaging/Resample.c) and torch's uint8 kernel ----------------------
// Both convolve separably (horizontal pass first, uint8 in between) with integer taps: PIL with a fixed 22-bit
// precision in int32; torch (ATen UpSampleKernel.cpp, _compute_index_ranges_int16_weights, the kernel torchvision's
// resize runs on uint8 tensors with antialias) with int16 taps at the largest precision that fits the axis' largest
// weight, and Keys' cubic written as ((a*x - 5a)*x + 8a)*x - 4a.

constexpr int kPrecisionBits = 32 - 8 - 2;

double bicubic(double x, bool torch) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return torch ? ((a * x - 5 * a) * x + 8 * a) * x - 4 * a : (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// Per output index: first input index, tap count, and ksize fixed-point taps at `prec` bits.
struct Taps {
  int ksize = 0, prec = kPrecisionBits;
  std::vector<int> first, count;
  std::vector<int32_t> k;
};

Taps precompute_taps(int in_size, int out_size, bool torch) {
  Taps t;
  const double scale = double(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);  // widen the kernel when shrinking (antialiasing)
  const double support = 2.0 * filterscale;
  t.ksize = int(std::ceil(support)) * 2 + 1;
  t.first.resize(out_size);
  t.count.resize(out_size);
  t.k.assign(size_t(out_size) * t.ksize, 0);
  std::vector<double> w(size_t(out_size) * t.ksize, 0.0);
  double wt_max = 0.0;
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    // Truncating casts, as in Pillow and ATen.
    const int xmin = std::max(int(center - support + 0.5), 0);
    const int xmax = std::clamp(std::min(int(center + support + 0.5), in_size) - xmin, 0, t.ksize);
    double* wx = &w[size_t(xx) * t.ksize];
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      wx[x] = bicubic((x + xmin - center + 0.5) * ss, torch);
      ww += wx[x];
    }
    if (ww != 0.0)
      for (int x = 0; x < xmax; ++x) wt_max = std::max(wt_max, wx[x] /= ww);
    t.first[xx] = xmin;
    t.count[xx] = xmax;
  }
  if (torch)  // the largest precision whose next step would not fit the largest weight in int16
    for (t.prec = 0; t.prec < 22; ++t.prec)
      if (int(0.5 + wt_max * (1 << (t.prec + 1))) >= (1 << 15)) break;
  for (size_t i = 0; i < w.size(); ++i) {
    const double v = w[i] * (1 << t.prec);
    t.k[i] = v < 0 ? int(-0.5 + v) : int(0.5 + v);
  }
  return t;
}

inline uint8_t clip8(int32_t ss, int prec) { return uint8_t(std::clamp(ss >> prec, 0, 255)); }

}  // namespace

// ---- public --------------------------------------------------------------------------------------------

ImageHeader read_image_header(const uint8_t* data, size_t size, const std::string& name) {
  static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (size == 0) fail(name + ": empty image file");
  ImageHeader h;
  if (size >= 8 && std::memcmp(data, png_sig, 8) == 0) {
    // IHDR is the first chunk (PNG spec 11.2.2): length, "IHDR", width and height big-endian.
    if (size < 24 || std::memcmp(data + 12, "IHDR", 4) != 0) fail(name + ": corrupt or truncated PNG file: no IHDR");
    auto be32 = [&](size_t o) { return uint32_t(data[o]) << 24 | data[o + 1] << 16 | data[o + 2] << 8 | data[o + 3]; };
    h.w = long(be32(16)), h.h = long(be32(20));
    return h;
  }
  if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff) {
    JpegRead j;  // jpeg_read_header reads the markers up to the first scan: no pixel is decoded
    jpeg_init(j);
    const bool ok = jpeg_read_header_phase(&j, data, size);
    h.w = j.cinfo.image_width, h.h = j.cinfo.image_height, h.jpeg = true;
    jpeg_destroy_decompress(&j.cinfo);
    if (!ok) fail(name + ": corrupt or truncated JPEG file: " + j.err.msg);
    return h;
  }
  fail(name + ": unsupported image format (only JPEG and PNG are read)");
}

RgbImage decode_image(const uint8_t* data, size_t size, const std::string& name, int scale) {
  const ImageHeader h = read_image_header(data, size, name);
  if (scale != 1 && (!h.jpeg || (scale != 2 && scale != 4 && scale != 8)))
    fail(name + ": cannot decode at 1/" + std::to_string(scale) + " (JPEG only, at 1/2, 1/4 or 1/8)");
  return h.jpeg ? decode_jpeg(data, size, name, scale) : decode_png(data, size, name);
}

RgbImage load_image(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open image file: " + std::strerror(errno));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) fail(path + ": error reading image file");
  return decode_image(bytes.data(), bytes.size(), path);
}

namespace {
bool png_write_phase(png_structp png, png_infop info, FILE* f, const uint8_t* rgb, int w, int h) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_init_io(png, f);
  png_set_IHDR(png, info, png_uint_32(w), png_uint_32(h), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h; ++y) png_write_row(png, rgb + size_t(y) * w * 3);
  png_write_end(png, nullptr);
  return true;
}
}  // namespace

void write_png(const std::string& path, const uint8_t* rgb, int w, int h) {
  if (w <= 0 || h <= 0) fail(path + ": cannot write an empty image");
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(path + ": cannot create PNG file: " + std::strerror(errno));
  PngRead r;  // only for its error buffer
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &r, png_on_error, png_on_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  const bool ok = png && info && png_write_phase(png, info, f, rgb, w, h);
  png_destroy_write_struct(&png, &info);
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) fail(path + ": cannot write PNG file" + (r.err[0] ? std::string(": ") + r.err : ""));
}

std::pair<int, int> smart_resize(int h, int w, int factor, long min_pixels, long max_pixels,
                                 const std::string& what) {
  if (h <= 0 || w <= 0) fail(what + ": image has no pixels");
  const double ratio = double(std::max(h, w)) / std::min(h, w);
  if (ratio > 200)
    fail(what + ": aspect ratio " + std::to_string(w) + "x" + std::to_string(h) +
         " is more extreme than 200:1 (Qwen2-VL's smart_resize refuses it)");
  // h/factor is exact in double, so nearbyint (round-half-to-even) is Python's round().
  long hb = long(std::nearbyint(double(h) / factor)) * factor;
  long wb = long(std::nearbyint(double(w) / factor)) * factor;
  const double hw = double(long(h) * w);
  if (hb * wb > max_pixels) {
    const double beta = std::sqrt(hw / double(max_pixels));
    hb = std::max<long>(factor, long(std::floor(h / beta / factor)) * factor);
    wb = std::max<long>(factor, long(std::floor(w / beta / factor)) * factor);
  } else if (hb * wb < min_pixels) {
    const double beta = std::sqrt(double(min_pixels) / hw);
    hb = long(std::ceil(h * beta / factor)) * factor;
    wb = long(std::ceil(w * beta / factor)) * factor;
  }
  return {int(hb), int(wb)};
}

namespace {
RgbImage resize_separable(const RgbImage& in, int w, int h, bool torch) {
  if (w <= 0 || h <= 0) fail("resize_bicubic: bad target size " + std::to_string(w) + "x" + std::to_string(h));
  // Pillow: horizontal pass first (only over the rows the vertical pass reads), uint8 in between.
  const Taps tv = precompute_taps(in.h, h, torch);
  const int y_first = tv.first[0];
  const int y_last = tv.first[h - 1] + tv.count[h - 1];
  RgbImage mid;
  int y_offset = 0;  // row of `in` that mid's row 0 is
  const RgbImage* src = &in;
  if (w != in.w) {
    const Taps th = precompute_taps(in.w, w, torch);
    mid.w = w;
    mid.h = y_last - y_first;
    mid.px.resize(size_t(mid.w) * mid.h * 3);
    for (int y = 0; y < mid.h; ++y) {
      const uint8_t* row = &in.px[size_t(y + y_first) * in.w * 3];
      uint8_t* out = &mid.px[size_t(y) * w * 3];
      for (int xx = 0; xx < w; ++xx) {
        const int32_t* k = &th.k[size_t(xx) * th.ksize];
        const uint8_t* p = row + size_t(th.first[xx]) * 3;
        int32_t s0 = 1 << (th.prec - 1), s1 = s0, s2 = s0;
        for (int x = 0; x < th.count[xx]; ++x, p += 3) {
          s0 += p[0] * k[x];
          s1 += p[1] * k[x];
          s2 += p[2] * k[x];
        }
        out[xx * 3 + 0] = clip8(s0, th.prec);
        out[xx * 3 + 1] = clip8(s1, th.prec);
        out[xx * 3 + 2] = clip8(s2, th.prec);
      }
    }
    src = &mid;
    y_offset = y_first;
  }
  if (h == in.h) {
    if (src == &in) return in;
    return mid;  // vertical pass not needed: mid holds every row
  }
  RgbImage out;
  out.w = src->w;
  out.h = h;
  out.px.resize(size_t(out.w) * h * 3);
  const size_t stride = size_t(src->w) * 3;
  std::vector<int32_t> acc(stride);  // a whole output row at a time: integer sums, so the order is free
  for (int yy = 0; yy < h; ++yy) {
    const int32_t* k = &tv.k[size_t(yy) * tv.ksize];
    const uint8_t* base = &src->px[size_t(tv.first[yy] - y_offset) * stride];
    std::fill(acc.begin(), acc.end(), 1 << (tv.prec - 1));
    for (int y = 0; y < tv.count[yy]; ++y) {
      const uint8_t* r = base + size_t(y) * stride;
      const int32_t ky = k[y];
      for (size_t i = 0; i < stride; ++i) acc[i] += r[i] * ky;
    }
    uint8_t* o = &out.px[size_t(yy) * stride];
    for (size_t i = 0; i < stride; ++i) o[i] = clip8(acc[i], tv.prec);
  }
  return out;
}

}  // namespace

RgbImage resize_bicubic(const RgbImage& in, int w, int h) { return resize_separable(in, w, h, false); }
RgbImage resize_bicubic_aa(const RgbImage& in, int w, int h) { return resize_separable(in, w, h, true); }

RgbImage resize_for_model(const RgbImage& in, const ImageConfig& cfg, const std::string& name) {
  if (in.w < cfg.min_side || in.h < cfg.min_side)
    fail(name + ": image is too small (" + std::to_string(in.w) + "x" + std::to_string(in.h) +
         "); the smallest side allowed is " + std::to_string(cfg.min_side) + " pixels");
  const auto [h, w] = smart_resize(in.h, in.w, cfg.factor(), cfg.min_pixels, cfg.max_pixels, name);
  return resize_bicubic(in, w, h);
}

ImageGrid patchify(const RgbImage& im, const ImageConfig& cfg, std::vector<float>& out) {
  const int P = cfg.patch, Tp = cfg.temporal_patch, m = cfg.merge;
  if (im.w % (P * m) || im.h % (P * m))
    fail("patchify: image " + std::to_string(im.w) + "x" + std::to_string(im.h) + " is not a multiple of " +
         std::to_string(P * m) + " on each side");
  // transformers: float32(double(v) * (1/255)), then (x - mean) / std in float32.
  float lut[3][256];
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v) lut[c][v] = (float(double(v) * (1.0 / 255.0)) - cfg.mean[c]) / cfg.std[c];

  ImageGrid g{1, im.h / P, im.w / P};
  const size_t row_len = size_t(3) * Tp * P * P;
  size_t pos = out.size();
  out.resize(pos + size_t(g.patches()) * row_len);
  for (int br = 0; br < g.h / m; ++br)
    for (int bc = 0; bc < g.w / m; ++bc)
      for (int ir = 0; ir < m; ++ir)
        for (int ic = 0; ic < m; ++ic) {
          const int y0 = (br * m + ir) * P, x0 = (bc * m + ic) * P;
          float* row = &out[pos];
          for (int c = 0; c < 3; ++c)
            for (int tt = 0; tt < Tp; ++tt)  // the one frame, repeated Tp times
              for (int py = 0; py < P; ++py) {
                const uint8_t* src = &im.px[(size_t(y0 + py) * im.w + x0) * 3 + c];
                float* dst = row + ((size_t(c) * Tp + tt) * P + py) * P;
                for (int px = 0; px < P; ++px) dst[px] = lut[c][src[size_t(px) * 3]];
              }
          pos += row_len;
        }
  return g;
}

ImageGrid preprocess(const RgbImage& in, const ImageConfig& cfg, std::vector<float>& out, const std::string& name) {
  return patchify(resize_for_model(in, cfg, name), cfg, out);
}

}  // namespace q3vl
