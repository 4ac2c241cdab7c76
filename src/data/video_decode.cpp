// Video decoding with libavformat/libavcodec/libswscale (see q3vl/data/video.hpp).
//
// Frames are found by timestamp: a first pass reads every packet of the video stream (no decoding) and keeps its
// pts, dts and keyframe flag in decode order. Sorted by pts, the packets give the presentation order, which is
// the order the decoder outputs frames in and what `select='eq(n\,K)'` counts. To get frame K we seek to the last
// keyframe at or before it, decode forward and keep the frames whose pts are wanted. When the packets do not map
// one to one onto frames (a missing or repeated pts, a frame whose pts no packet had), we decode from the start
// and count frames instead, as the ffmpeg command line does.
#include "q3vl/data/video.hpp"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "q3vl/core/error.hpp"

#ifndef Q3VL_FFMPEG
#define Q3VL_FFMPEG 1
#endif

#if Q3VL_FFMPEG
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <map>

#include "data/ffmpeg_util.hpp"

namespace q3vl {

namespace {
// The last error FFmpeg logged on this thread: it often says more than the error code ("moov atom not found").
thread_local std::string t_last_log;

void log_callback(void* avcl, int level, const char* fmt, va_list vl) {
  if (level <= AV_LOG_ERROR) {
    va_list copy;
    va_copy(copy, vl);
    char line[512];
    int prefix = 0;
    av_log_format_line(avcl, level, fmt, copy, line, sizeof line, &prefix);
    va_end(copy);
    t_last_log = line;
    while (!t_last_log.empty() && (t_last_log.back() == '\n' || t_last_log.back() == ' ')) t_last_log.pop_back();
  }
  av_log_default_callback(avcl, level, fmt, vl);
}

}  // namespace

// FFmpeg's messages go into our errors instead of stderr, unless the program chose a log level itself.
void hook_libav_log() {
  static const bool once = [] {
    if (av_log_get_level() == AV_LOG_INFO) av_log_set_level(AV_LOG_FATAL);
    av_log_set_callback(log_callback);
    return true;
  }();
  (void)once;
  t_last_log.clear();
}

std::string av_message(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(err, buf, sizeof buf);
  // FFmpeg's logged line names the fault ("moov atom not found"); the code's string can mislead (a y4m header of
  // 100000x100000 gives EBUSY), so it follows in brackets.
  if (t_last_log.empty() || t_last_log == buf) return buf;
  return t_last_log + " (" + buf + ")";
}

namespace {

struct FormatClose {
  void operator()(AVFormatContext* f) const { avformat_close_input(&f); }
};
struct IoFree {  // the buffer may have been replaced by libavformat: free the current one
  void operator()(AVIOContext* io) const {
    av_freep(&io->buffer);
    avio_context_free(&io);
  }
};

// ---- bytes in memory as an AVIOContext ------------------------------------------------------------------

struct MemInput {
  std::string_view bytes;
  int64_t pos = 0;
};

int mem_read(void* opaque, uint8_t* buf, int n) {
  auto* m = static_cast<MemInput*>(opaque);
  const int64_t left = int64_t(m->bytes.size()) - m->pos;
  if (left <= 0) return AVERROR_EOF;
  const int k = int(std::min<int64_t>(n, left));
  std::memcpy(buf, m->bytes.data() + m->pos, size_t(k));
  m->pos += k;
  return k;
}

int64_t mem_seek(void* opaque, int64_t offset, int whence) {
  auto* m = static_cast<MemInput*>(opaque);
  const int64_t size = int64_t(m->bytes.size());
  if (whence & AVSEEK_SIZE) return size;
  int64_t to = offset;
  switch (whence & ~AVSEEK_FORCE) {
    case SEEK_SET: break;
    case SEEK_CUR: to += m->pos; break;
    case SEEK_END: to += size; break;
    default: return AVERROR(EINVAL);
  }
  if (to < 0 || to > size) return AVERROR(EINVAL);
  m->pos = to;
  return to;
}

// ---- orientation (ffmpeg's autorotate) ------------------------------------------------------------------

// What the command line's autorotate inserts before the other filters: a transpose (with its direction
// flags) or an hflip/vflip pair. src row/column of output pixel (r, c) for an input of h x w:
//   transpose: (flip_rows ? h-1-c : c, flip_cols ? w-1-r : r); otherwise (vflip ? h-1-r : r, hflip ? w-1-c : c).
struct Orient {
  bool transpose = false, flip_rows = false, flip_cols = false;  // transpose=clock is (1, 1, 0)
  bool hflip = false, vflip = false;
  int degrees = 0;
  bool identity() const { return !transpose && !hflip && !vflip; }
};

// fftools' get_rotation and its choice of filters (ffmpeg 5.1). Angles not a multiple of 90 are left alone.
Orient orientation(const int32_t* m) {
  Orient o;
  if (!m) return o;
  double theta = -std::round(av_display_rotation_get(m));
  theta -= 360 * std::floor(theta / 360 + 0.9 / 360);
  if (std::fabs(theta - 90) < 1.0) {
    o.degrees = 90;
    o.transpose = true;
    if (m[3] <= 0) o.flip_rows = true;  // "clock"; m[3] > 0 is "cclock_flip", a plain transpose
  } else if (std::fabs(theta - 180) < 1.0) {
    o.degrees = 180;
    o.hflip = m[0] < 0;
    o.vflip = m[4] < 0;
  } else if (std::fabs(theta - 270) < 1.0) {
    o.degrees = 270;
    o.transpose = true;
    if (m[3] < 0) o.flip_rows = o.flip_cols = true;  // "clock_flip"
    else o.flip_cols = true;                          // "cclock"
  } else if (std::fabs(theta) < 1.0) {
    o.vflip = m[4] < 0;
  }
  return o;
}

// Whether the frame's planes can be moved pixel by pixel (as vf_transpose/hflip/vflip do): no palette, no
// bit-packed pixels, and for a transpose the same chroma subsampling both ways.
bool can_orient_planes(AVPixelFormat fmt, const Orient& o) {
  const AVPixFmtDescriptor* d = av_pix_fmt_desc_get(fmt);
  if (!d || (d->flags & (AV_PIX_FMT_FLAG_PAL | AV_PIX_FMT_FLAG_BITSTREAM | AV_PIX_FMT_FLAG_HWACCEL))) return false;
  return !o.transpose || d->log2_chroma_w == d->log2_chroma_h;
}

// A new frame with the orientation applied to every plane (pixel steps as the descriptor gives them).
FramePtr orient_planes(const AVFrame* in, const Orient& o) {
  const AVPixFmtDescriptor* d = av_pix_fmt_desc_get(AVPixelFormat(in->format));
  FramePtr out = new_frame();
  out->format = in->format;
  out->width = o.transpose ? in->height : in->width;
  out->height = o.transpose ? in->width : in->height;
  int err = av_frame_copy_props(out.get(), in);
  if (err >= 0) err = av_frame_get_buffer(out.get(), 0);
  if (err < 0) fail("video: cannot allocate a rotated frame: " + av_message(err));
  int step[4] = {0, 0, 0, 0};
  for (int c = 0; c < d->nb_components; ++c)
    step[d->comp[c].plane] = std::max(step[d->comp[c].plane], d->comp[c].step);
  for (int p = 0; p < 4 && in->data[p]; ++p) {
    const bool chroma = p == 1 || p == 2;
    const int iw = chroma ? AV_CEIL_RSHIFT(in->width, d->log2_chroma_w) : in->width;
    const int ih = chroma ? AV_CEIL_RSHIFT(in->height, d->log2_chroma_h) : in->height;
    const int ow = o.transpose ? ih : iw, oh = o.transpose ? iw : ih, s = step[p];
    for (int r = 0; r < oh; ++r) {
      uint8_t* dst = out->data[p] + ptrdiff_t(r) * out->linesize[p];
      for (int c = 0; c < ow; ++c) {
        int sr, sc;
        if (o.transpose) {
          sr = o.flip_rows ? ih - 1 - c : c;
          sc = o.flip_cols ? iw - 1 - r : r;
        } else {
          sr = o.vflip ? ih - 1 - r : r;
          sc = o.hflip ? iw - 1 - c : c;
        }
        std::memcpy(dst + ptrdiff_t(c) * s, in->data[p] + ptrdiff_t(sr) * in->linesize[p] + ptrdiff_t(sc) * s, s);
      }
    }
  }
  return out;
}

// The same on an RGB image, for pixel formats whose planes cannot be moved (the command line converts those first).
RgbImage orient_rgb(const RgbImage& in, const Orient& o) {
  AVFrame f{};
  f.format = AV_PIX_FMT_RGB24;
  f.width = in.w;
  f.height = in.h;
  f.data[0] = const_cast<uint8_t*>(in.px.data());
  f.linesize[0] = in.w * 3;
  FramePtr t = orient_planes(&f, o);
  RgbImage out;
  out.w = t->width;
  out.h = t->height;
  out.px.resize(size_t(out.w) * out.h * 3);
  for (int y = 0; y < out.h; ++y)
    std::memcpy(&out.px[size_t(y) * out.w * 3], t->data[0] + ptrdiff_t(y) * t->linesize[0], size_t(out.w) * 3);
  return out;
}

// ---- RGB conversion as the command line's auto-inserted scale filter ----------------------------------

// vf_scale's parse_yuv_type("auto", frame colorspace): the frame's matrix, BT.601 when it is out of range.
const int* yuv_coefficients(AVColorSpace cs) {
  int c = int(cs);
  if (c < 1 || c > 10 || c == 8) c = AVCOL_SPC_BT470BG;
  return sws_getCoefficients(c);
}

class RgbConverter {
 public:
  // A frame of any pixel format to packed RGB24, as `-pix_fmt rgb24` does: sws flags "bicubic" (fftools' default
  // sws_flags), MPEG-2 chroma siting for yuv420p, then the frame's colour matrix and range.
  RgbImage convert(const AVFrame* f, const std::string& name) {
    setup(f, name);
    const int* table = yuv_coefficients(f->colorspace);
    int *inv = nullptr, *tab = nullptr, in_full = 0, out_full = 0, bri = 0, con = 0, sat = 0;
    sws_getColorspaceDetails(sws_.get(), &inv, &in_full, &tab, &out_full, &bri, &con, &sat);
    if (f->color_range != AVCOL_RANGE_UNSPECIFIED) in_full = f->color_range == AVCOL_RANGE_JPEG;
    sws_setColorspaceDetails(sws_.get(), table, in_full, table, out_full, bri, con, sat);
    // swscale may write past the end of a row: convert into a padded frame, then copy the rows out
    if (!rgb_ || rgb_->width != f->width || rgb_->height != f->height) {
      rgb_ = new_frame();
      rgb_->format = AV_PIX_FMT_RGB24;
      rgb_->width = f->width;
      rgb_->height = f->height;
      const int err = av_frame_get_buffer(rgb_.get(), 0);
      if (err < 0) fail(name + ": cannot allocate an RGB frame: " + av_message(err));
    }
    const int rows = sws_scale(sws_.get(), f->data, f->linesize, 0, f->height, rgb_->data, rgb_->linesize);
    if (rows != f->height) fail(name + ": cannot convert a frame to RGB (libswscale failed)");
    RgbImage im;
    im.w = f->width;
    im.h = f->height;
    im.px.resize(size_t(im.w) * im.h * 3);
    for (int y = 0; y < im.h; ++y)
      std::memcpy(&im.px[size_t(y) * im.w * 3], rgb_->data[0] + ptrdiff_t(y) * rgb_->linesize[0], size_t(im.w) * 3);
    return im;
  }

 private:
  void setup(const AVFrame* f, const std::string& name) {
    if (sws_ && w_ == f->width && h_ == f->height && fmt_ == f->format) return;
    sws_.reset(sws_alloc_context());
    if (!sws_) fail(name + ": out of memory allocating a libswscale context");
    SwsContext* s = sws_.get();
    av_opt_set_int(s, "srcw", f->width, 0);
    av_opt_set_int(s, "srch", f->height, 0);
    av_opt_set_int(s, "src_format", f->format, 0);
    av_opt_set_int(s, "dstw", f->width, 0);
    av_opt_set_int(s, "dsth", f->height, 0);
    av_opt_set_int(s, "dst_format", AV_PIX_FMT_RGB24, 0);
    av_opt_set_int(s, "sws_flags", SWS_BICUBIC, 0);
    if (f->format == AV_PIX_FMT_YUV420P) av_opt_set_int(s, "src_v_chr_pos", 128, 0);
    const int err = sws_init_context(s, nullptr, nullptr);
    if (err < 0) {
      sws_.reset();
      fail(name + ": libswscale cannot convert " + std::string(av_get_pix_fmt_name(AVPixelFormat(f->format)) ?: "?") +
           " to RGB: " + av_message(err));
    }
    w_ = f->width;
    h_ = f->height;
    fmt_ = f->format;
  }

  std::unique_ptr<SwsContext, SwsFree> sws_;
  FramePtr rgb_;
  int w_ = 0, h_ = 0, fmt_ = -1;
};

// ---- the packet table -----------------------------------------------------------------------------------

struct PacketInfo {
  int64_t pts = AV_NOPTS_VALUE, dts = AV_NOPTS_VALUE;
  bool key = false, discard = false;
};

// Presentation order of a stream's packets (decode order in `packets`); usable only when every packet has a
// pts and no two share one.
struct PacketTable {
  std::vector<PacketInfo> packets;  // decode order
  std::vector<int64_t> shown;       // pts of the shown frames, ascending: shown[K] is frame K
  std::vector<std::pair<int64_t, int64_t>> by_pts;  // (pts, decode position), ascending
  bool usable = false;

  void finish() {
    usable = !packets.empty();
    for (size_t i = 0; i < packets.size(); ++i) {
      if (packets[i].pts == AV_NOPTS_VALUE) usable = false;
      by_pts.emplace_back(packets[i].pts, int64_t(i));
      if (!packets[i].discard) shown.push_back(packets[i].pts);
    }
    std::sort(by_pts.begin(), by_pts.end());
    std::sort(shown.begin(), shown.end());
    for (size_t i = 1; i < by_pts.size(); ++i)
      if (by_pts[i].first == by_pts[i - 1].first) usable = false;
  }
  int64_t position(int64_t pts) const {  // decode position of the packet with this pts, -1 if none
    auto it = std::lower_bound(by_pts.begin(), by_pts.end(), std::make_pair(pts, int64_t(-1)));
    return it != by_pts.end() && it->first == pts ? it->second : -1;
  }
  int64_t frame_index(int64_t pts) const {  // K with shown[K] == pts, -1 if none
    auto it = std::lower_bound(shown.begin(), shown.end(), pts);
    return it != shown.end() && *it == pts ? int64_t(it - shown.begin()) : -1;
  }
  // Decode position of the last keyframe, in decode order at or before frame K, whose pts is not after K's:
  // decoding from there gives K (leading frames of an open GOP belong to the keyframe before).
  int64_t keyframe_for(int64_t k) const {
    const int64_t pts = shown[size_t(k)], pos = position(pts);
    for (int64_t p = pos; p >= 0; --p)
      if (packets[size_t(p)].key && packets[size_t(p)].pts <= pts) return p;
    return 0;
  }
};

}  // namespace

// ---- VideoFile --------------------------------------------------------------------------------------------

struct VideoFile::Impl {
  std::string name;
  std::string path;  // empty when reading bytes
  MemInput mem;
  VideoLimits limits;
  std::unique_ptr<AVIOContext, IoFree> io;
  std::unique_ptr<AVFormatContext, FormatClose> fmt;
  std::unique_ptr<AVCodecContext, CodecFree> dec;
  int stream = -1;
  Orient orient;
  VideoInfo info;
  PacketTable table;
  RgbConverter rgb;
  PacketPtr pkt;
  int64_t sent = -1;  // decode position of the last packet sent to the decoder, -1 after a seek
  int64_t decoded = 0;  // frames the decoder gave

  void open();
  void open_input();
  void open_decoder();
  void check_size(const AVCodecParameters* par) const;
  void fill_info();
  void scan();
  AVStream* st() const { return fmt->streams[stream]; }
  [[noreturn]] void fail_av(const std::string& what, int err) const {
    fail(name + ": " + what + ": " + av_message(err));
  }
  // Decoding.
  RgbImage to_rgb(const AVFrame* f);
  bool read_video_packet();
  int64_t packet_position() const { return table.position(pkt->pts); }
  bool seek_to(int64_t keypos);
  void rewind();
  void send_packet(const AVPacket* p);
  bool frames_by_pts(const std::vector<int64_t>& wanted, std::vector<RgbImage>& out);
  void frames_by_count(const std::vector<int64_t>& wanted, std::vector<RgbImage>& out);
};

void VideoFile::Impl::open_input() {
  hook_libav_log();
  fmt.reset();
  io.reset();
  AVFormatContext* f = avformat_alloc_context();
  if (!f) fail(name + ": out of memory allocating a format context");
  if (path.empty()) {
    mem.pos = 0;
    const int size = 1 << 16;
    auto* buf = static_cast<uint8_t*>(av_malloc(size));
    if (buf) io.reset(avio_alloc_context(buf, size, 0, &mem, mem_read, nullptr, mem_seek));
    if (!io) {
      av_free(buf);
      avformat_free_context(f);
      fail(name + ": out of memory allocating an I/O context");
    }
    f->pb = io.get();
    f->flags |= AVFMT_FLAG_CUSTOM_IO;
  }
  int err = avformat_open_input(&f, path.empty() ? nullptr : path.c_str(), nullptr, nullptr);
  if (err < 0) fail_av(path.empty() ? "cannot read video" : "cannot open video file", err);  // f was freed
  fmt.reset(f);
  // Sizes the header tells are checked before any frame is decoded; the decoders that find_stream_info runs
  // refuse larger frames themselves.
  for (unsigned i = 0; i < f->nb_streams; ++i)
    if (f->streams[i]->codecpar->codec_type == AVMEDIA_TYPE_VIDEO && f->streams[i]->codecpar->width > 0)
      check_size(f->streams[i]->codecpar);
  std::vector<AVDictionary*> opts(f->nb_streams, nullptr);
  for (AVDictionary*& d : opts) av_dict_set_int(&d, "max_pixels", limits.max_pixels, 0);
  err = avformat_find_stream_info(f, opts.data());
  for (AVDictionary*& d : opts) av_dict_free(&d);
  if (err < 0) fail_av("cannot read the video's streams", err);
  stream = av_find_best_stream(f, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
  if (stream >= 0 && (f->streams[stream]->disposition & AV_DISPOSITION_ATTACHED_PIC)) stream = -1;
  if (stream < 0) fail(name + ": has no video stream (" + std::string(f->iformat->name) + " file)");
  for (unsigned i = 0; i < f->nb_streams; ++i)
    if (int(i) != stream) f->streams[i]->discard = AVDISCARD_ALL;
}

void VideoFile::Impl::check_size(const AVCodecParameters* par) const {
  const std::string size = std::to_string(par->width) + "x" + std::to_string(par->height);
  if (par->width <= 0 || par->height <= 0) fail(name + ": the video stream has no frame size (" + size + ")");
  if (par->width > limits.max_side || par->height > limits.max_side ||
      long(par->width) * par->height > limits.max_pixels)
    fail(name + ": video frames are " + size + ", over the limit of " + std::to_string(limits.max_side) +
         " pixels a side and " + std::to_string(limits.max_pixels) + " pixels a frame");
}

void VideoFile::Impl::open_decoder() {
  const AVCodecParameters* par = st()->codecpar;
  check_size(par);
  const AVCodec* codec = avcodec_find_decoder(par->codec_id);
  if (!codec) {
    char tag[AV_FOURCC_MAX_STRING_SIZE] = {0};
    av_fourcc_make_string(tag, par->codec_tag);
    fail(name + ": unsupported video codec '" + avcodec_get_name(par->codec_id) + "' (tag " + tag +
         "): this FFmpeg has no decoder for it");
  }
  dec.reset(avcodec_alloc_context3(codec));
  if (!dec) fail(name + ": out of memory allocating a decoder");
  int err = avcodec_parameters_to_context(dec.get(), par);
  if (err < 0) fail_av("cannot set up the decoder", err);
  dec->pkt_timebase = st()->time_base;
  dec->max_pixels = limits.max_pixels;
  err = avcodec_open2(dec.get(), codec, nullptr);
  if (err < 0) fail_av(std::string("cannot open the ") + codec->name + " decoder", err);
  if (!pkt) pkt.reset(av_packet_alloc());
  if (!pkt) fail(name + ": out of memory allocating a packet");
  sent = -1;
}

// Every packet of the stream, without decoding (cheap: the container's reading only).
void VideoFile::Impl::scan() {
  int err;
  while ((err = av_read_frame(fmt.get(), pkt.get())) >= 0) {
    if (pkt->stream_index == stream) {
      PacketInfo p;
      p.pts = pkt->pts;
      p.dts = pkt->dts;
      p.key = pkt->flags & AV_PKT_FLAG_KEY;
      p.discard = pkt->flags & AV_PKT_FLAG_DISCARD;
      table.packets.push_back(p);
    }
    av_packet_unref(pkt.get());
    if (int64_t(table.packets.size()) > limits.max_frames)
      fail(name + ": has more than the limit of " + std::to_string(limits.max_frames) + " frames");
  }
  if (err != AVERROR_EOF) fail_av("cannot read the video", err);
  table.finish();
  sent = -2;  // at the end: the next frames() seeks
}

void VideoFile::Impl::fill_info() {
  AVStream* s = st();
  const int32_t* m = reinterpret_cast<const int32_t*>(av_stream_get_side_data(s, AV_PKT_DATA_DISPLAYMATRIX, nullptr));
  orient = orientation(m);
  info.rotation = orient.degrees;
  info.codec = avcodec_get_name(s->codecpar->codec_id);
  info.width = orient.transpose ? s->codecpar->height : s->codecpar->width;
  info.height = orient.transpose ? s->codecpar->width : s->codecpar->height;
  if (s->nb_frames > limits.max_frames)
    fail(name + ": has " + std::to_string(s->nb_frames) + " frames, more than the limit of " +
         std::to_string(limits.max_frames) + " frames");
  scan();
  info.frames = int64_t(table.shown.size());
  info.nb_frames = s->nb_frames > 0 ? s->nb_frames : 0;
  if (info.frames <= 0) fail(name + ": the video stream has no frames");
  if (s->duration != AV_NOPTS_VALUE && s->duration > 0) info.duration = double(s->duration) * av_q2d(s->time_base);
  else if (fmt->duration != AV_NOPTS_VALUE && fmt->duration > 0) info.duration = double(fmt->duration) / AV_TIME_BASE;
  if (s->avg_frame_rate.num > 0 && s->avg_frame_rate.den > 0) info.fps = av_q2d(s->avg_frame_rate);
  else if (info.duration > 0) info.fps = double(info.frames) / info.duration;
  else if (s->r_frame_rate.num > 0 && s->r_frame_rate.den > 0) info.fps = av_q2d(s->r_frame_rate);
  if (info.duration <= 0 && info.fps > 0) info.duration = double(info.frames) / info.fps;
}

void VideoFile::Impl::open() {
  open_input();
  open_decoder();
  fill_info();
}

void VideoFile::Impl::rewind() {
  open_input();
  open_decoder();
}

RgbImage VideoFile::Impl::to_rgb(const AVFrame* f) {
  const int w = orient.transpose ? f->height : f->width, h = orient.transpose ? f->width : f->height;
  if (w != info.width || h != info.height)
    fail(name + ": a frame is " + std::to_string(f->width) + "x" + std::to_string(f->height) +
         " where the stream is " + std::to_string(st()->codecpar->width) + "x" +
         std::to_string(st()->codecpar->height) + " (frame size changes are not supported)");
  if (orient.identity()) return rgb.convert(f, name);
  if (can_orient_planes(AVPixelFormat(f->format), orient)) {
    FramePtr turned = orient_planes(f, orient);
    return rgb.convert(turned.get(), name);
  }
  return orient_rgb(rgb.convert(f, name), orient);
}

// The next packet of the video stream into pkt; false at the end of the file.
bool VideoFile::Impl::read_video_packet() {
  for (;;) {
    av_packet_unref(pkt.get());
    const int err = av_read_frame(fmt.get(), pkt.get());
    if (err == AVERROR_EOF) return false;
    if (err < 0) fail_av("cannot read the video", err);
    if (pkt->stream_index == stream) return true;
  }
}


// Seeks so that the next packet is at or before decode position keypos (the packet is left in pkt); false when
// the container cannot. Containers index keyframes by pts (matroska) or dts (mp4): the pts first, since it lands
// on the keyframe itself, then the earlier of the two, which cannot land after it.
bool VideoFile::Impl::seek_to(int64_t keypos) {
  const PacketInfo& k = table.packets[size_t(keypos)];
  for (const int64_t ts : {k.pts, k.dts != AV_NOPTS_VALUE ? std::min(k.pts, k.dts) : k.pts}) {
    const int err = av_seek_frame(fmt.get(), stream, ts, AVSEEK_FLAG_BACKWARD);
    avcodec_flush_buffers(dec.get());
    sent = -1;
    if (err < 0 || !read_video_packet()) return false;
    const int64_t pos = packet_position();
    if (pos >= 0 && pos <= keypos) return true;
  }
  return false;
}

// As the command line: a packet the decoder rejects as invalid is skipped (its frame never appears).
void VideoFile::Impl::send_packet(const AVPacket* p) {
  const int err = avcodec_send_packet(dec.get(), p);
  if (err < 0 && err != AVERROR_INVALIDDATA && err != AVERROR(EAGAIN) && err != AVERROR_EOF)
    fail_av("cannot decode the video", err);
}

// Frames by pts through the packet table; false when the stream does not follow the table (then nothing in
// `out` is to be trusted).
bool VideoFile::Impl::frames_by_pts(const std::vector<int64_t>& wanted, std::vector<RgbImage>& out) {
  FramePtr frame = new_frame();
  size_t next = 0;
  int64_t seeked = -1;
  bool flushed = false;
  // A frame whose packet an earlier call sent has come out or was skipped: go back to its keyframe.
  if (sent >= 0 && table.position(table.shown[size_t(wanted[0])]) <= sent) sent = -2;
  while (next < wanted.size()) {
    const int err = avcodec_receive_frame(dec.get(), frame.get());
    if (err == 0) {
      ++decoded;
      const int64_t pts = frame->pts != AV_NOPTS_VALUE ? frame->pts : frame->best_effort_timestamp;
      const int64_t k = table.frame_index(pts);
      if (k < 0 || k > wanted[next]) return false;  // an unknown frame, or a wanted one never came out
      if (k == wanted[next]) out[next++] = to_rgb(frame.get());
      av_frame_unref(frame.get());
      continue;
    }
    if (err == AVERROR_EOF) return false;  // the decoder gave fewer frames than the container has packets
    if (err != AVERROR(EAGAIN)) fail_av("cannot decode the video", err);
    const int64_t keypos = table.keyframe_for(wanted[next]);
    if (sent == -2 || (keypos > sent && keypos != seeked)) {  // cheaper to jump to the keyframe than to decode to it
      if (!seek_to(keypos)) return false;
      seeked = keypos;  // the seek may land before it: decode on from there
      flushed = false;
    } else if (flushed || !read_video_packet()) {
      if (flushed) return false;
      send_packet(nullptr);  // end of file: drain the decoder
      flushed = true;
      continue;
    }
    // Frames no other frame refers to are skipped unless wanted: the others decode the same without them.
    sent = packet_position();
    if (sent < 0) return false;
    dec->skip_frame = std::binary_search(wanted.begin() + ptrdiff_t(next), wanted.end(), table.frame_index(pkt->pts))
                          ? AVDISCARD_DEFAULT
                          : AVDISCARD_NONREF;
    send_packet(pkt.get());
  }
  return true;
}

// Frames by counting what the decoder gives from the start of the file: the command line's own numbering.
void VideoFile::Impl::frames_by_count(const std::vector<int64_t>& wanted, std::vector<RgbImage>& out) {
  rewind();
  FramePtr frame = new_frame();
  size_t next = 0;
  int64_t n = 0;
  bool flushed = false;
  while (next < wanted.size()) {
    const int err = avcodec_receive_frame(dec.get(), frame.get());
    if (err == 0) {
      ++decoded;
      if (n++ == wanted[next]) out[next++] = to_rgb(frame.get());
      av_frame_unref(frame.get());
    } else if (err == AVERROR_EOF) {
      fail(name + ": frame " + std::to_string(wanted[next]) + " is past the end of the video: decoding gives " +
           std::to_string(n) + " frames (the container says " + std::to_string(info.frames) + ")");
    } else if (err != AVERROR(EAGAIN)) {
      fail_av("cannot decode the video", err);
    } else if (!flushed && read_video_packet()) {
      send_packet(pkt.get());
    } else {
      send_packet(nullptr);
      flushed = true;
    }
  }
  sent = -2;
}

VideoFile::VideoFile(const std::string& path, const VideoLimits& limits) : impl_(std::make_unique<Impl>()) {
  impl_->name = impl_->path = path;
  impl_->limits = limits;
  if (path.empty()) fail("video: empty file name");
  impl_->open();
}

VideoFile::VideoFile(std::string_view bytes, const std::string& name, const VideoLimits& limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->name = name;
  impl_->mem.bytes = bytes;
  impl_->limits = limits;
  if (bytes.empty()) fail(name + ": empty video (0 bytes)");
  impl_->open();
}

VideoFile::~VideoFile() = default;
VideoFile::VideoFile(VideoFile&&) noexcept = default;
VideoFile& VideoFile::operator=(VideoFile&&) noexcept = default;

const VideoInfo& VideoFile::info() const { return impl_->info; }
const std::string& VideoFile::name() const { return impl_->name; }
int64_t VideoFile::frames_decoded() const { return impl_->decoded; }

std::vector<RgbImage> VideoFile::frames(const std::vector<int64_t>& indices) {
  Impl& v = *impl_;
  hook_libav_log();
  for (int64_t k : indices)
    if (k < 0 || k >= v.info.frames)
      fail(v.name + ": frame " + std::to_string(k) + " is past the end of the video (" +
           std::to_string(v.info.frames) + " frames)");
  std::vector<int64_t> wanted(indices);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::vector<RgbImage> got(wanted.size());
  if (wanted.empty()) return {};
  const bool by_pts = v.table.usable && wanted.back() < int64_t(v.table.shown.size());
  if (!by_pts || !v.frames_by_pts(wanted, got)) v.frames_by_count(wanted, got);
  std::vector<RgbImage> out;
  out.reserve(indices.size());
  for (int64_t k : indices)
    out.push_back(got[size_t(std::lower_bound(wanted.begin(), wanted.end(), k) - wanted.begin())]);
  return out;
}

}  // namespace q3vl

#else  // FFMPEG=0: built without FFmpeg's libraries; frame lists still work

namespace q3vl {

struct VideoFile::Impl {
  VideoInfo info;
  std::string name;
};

namespace {
[[noreturn]] void no_ffmpeg(const std::string& name) {
  fail(name + ": this q3vl was built without FFmpeg (make FFMPEG=0), so it cannot decode video files; build it "
       "with FFmpeg's libraries (make deps; make) or give the video as a list of frame images");
}
}  // namespace

VideoFile::VideoFile(const std::string& path, const VideoLimits&) { no_ffmpeg(path); }
VideoFile::VideoFile(std::string_view, const std::string& name, const VideoLimits&) { no_ffmpeg(name); }
VideoFile::~VideoFile() = default;
VideoFile::VideoFile(VideoFile&&) noexcept = default;
VideoFile& VideoFile::operator=(VideoFile&&) noexcept = default;
const VideoInfo& VideoFile::info() const { return impl_->info; }
const std::string& VideoFile::name() const { return impl_->name; }
int64_t VideoFile::frames_decoded() const { return 0; }
std::vector<RgbImage> VideoFile::frames(const std::vector<int64_t>&) { no_ffmpeg(impl_->name); }

}  // namespace q3vl

#endif  // Q3VL_FFMPEG

namespace q3vl {

VideoInfo probe_video(const std::string& path, const VideoLimits& limits) { return VideoFile(path, limits).info(); }
VideoInfo probe_video(std::string_view bytes, const std::string& name, const VideoLimits& limits) {
  return VideoFile(bytes, name, limits).info();
}
std::vector<RgbImage> decode_frames(const std::string& path, const std::vector<int64_t>& indices,
                                    const VideoLimits& limits) {
  return VideoFile(path, limits).frames(indices);
}
std::vector<RgbImage> decode_frames(std::string_view bytes, const std::string& name,
                                    const std::vector<int64_t>& indices, const VideoLimits& limits) {
  return VideoFile(bytes, name, limits).frames(indices);
}

// ---- frame lists ------------------------------------------------------------------------------------------

VideoInfo probe_frame_list(const std::vector<std::string>& paths, double fps) {
  if (paths.empty()) fail("video: an empty list of frames");
  if (!(fps > 0)) fail("video: frame list of " + paths.front() + "...: fps must be positive");
  VideoInfo info;
  for (const std::string& p : paths) {
    std::ifstream f(p, std::ios::binary);
    if (!f) fail(p + ": cannot open video frame: " + std::strerror(errno));
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const ImageHeader h = read_image_header(bytes.data(), bytes.size(), p);
    if (&p == &paths.front()) {
      info.width = int(h.w);
      info.height = int(h.h);
    } else if (h.w != info.width || h.h != info.height) {
      fail(p + ": video frame is " + std::to_string(h.w) + "x" + std::to_string(h.h) + ", the first frame (" +
           paths.front() + ") is " + std::to_string(info.width) + "x" + std::to_string(info.height));
    }
  }
  info.frames = int64_t(paths.size());
  info.fps = fps;
  info.duration = double(info.frames) / fps;
  info.codec = "image";
  return info;
}

std::vector<RgbImage> load_frame_list(const std::vector<std::string>& paths, const std::vector<int64_t>& indices) {
  std::vector<RgbImage> out;
  out.reserve(indices.size());
  for (int64_t k : indices) {
    if (k < 0 || k >= int64_t(paths.size()))
      fail("video: frame " + std::to_string(k) + " is past the end of the frame list (" +
           std::to_string(paths.size()) + " frames" + (paths.empty() ? "" : ", from " + paths.front()) + ")");
    out.push_back(load_image(paths[size_t(k)]));
    if (out.back().w != out.front().w || out.back().h != out.front().h)
      fail(paths[size_t(k)] + ": video frame is " + std::to_string(out.back().w) + "x" +
           std::to_string(out.back().h) + ", frame " + std::to_string(indices.front()) + " is " +
           std::to_string(out.front().w) + "x" + std::to_string(out.front().h));
  }
  return out;
}

}  // namespace q3vl
