// Video encoding with libavformat/libavcodec/libswscale (see q3vl/data/video.hpp): RGB frames -> yuv420p ->
// an encoder -> a container, for `q3vl synth`'s clips and the decoder's tests. The counterpart of video_decode.cpp.
#include "q3vl/data/video.hpp"

#include <cmath>
#include <filesystem>
#include <system_error>

#include "q3vl/core/error.hpp"

#ifndef Q3VL_FFMPEG
#define Q3VL_FFMPEG 1
#endif

#if Q3VL_FFMPEG
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/opt.h>
#include <libswscale/swscale.h>
}

#include "data/ffmpeg_util.hpp"

namespace q3vl {
namespace {

struct OutputFree {
  void operator()(AVFormatContext* f) const {
    if (f->pb && !(f->oformat->flags & AVFMT_NOFILE)) avio_closep(&f->pb);
    avformat_free_context(f);
  }
};

// One clip being written: the muxer, the encoder, the RGB -> YUV converter. The file is path.partial until
// finish() renames it; a clip given up (an exception) leaves no file behind.
class ClipWriter {
 public:
  ClipWriter(const std::string& path, const std::string& encoder, int w, int h, double fps);
  ~ClipWriter();
  void add(const RgbImage& im, int64_t index);
  void finish();

 private:
  std::string path_, partial_, encoder_;
  std::unique_ptr<AVFormatContext, OutputFree> fmt_;
  std::unique_ptr<AVCodecContext, CodecFree> enc_;
  std::unique_ptr<SwsContext, SwsFree> sws_;
  FramePtr yuv_ = new_frame();
  PacketPtr pkt_{av_packet_alloc()};
  AVStream* st_ = nullptr;
  bool done_ = false;

  [[noreturn]] void fail_av(const std::string& what, int err) const {
    fail(path_ + ": cannot write video (" + encoder_ + "): " + what + ": " + av_message(err));
  }
  void open_encoder(int w, int h, double fps);
  void send(const AVFrame* f);  // nullptr: drain the encoder
};

ClipWriter::ClipWriter(const std::string& path, const std::string& encoder, int w, int h, double fps)
    : path_(path), partial_(path + ".partial"), encoder_(encoder) {
  hook_libav_log();
  if (!pkt_) fail(path_ + ": out of memory allocating a packet");
  const AVOutputFormat* of = av_guess_format(nullptr, path.c_str(), nullptr);
  if (!of) fail(path_ + ": cannot write video: no container for this file name (name it .mp4, .mkv or .avi)");
  AVFormatContext* f = nullptr;
  if (const int err = avformat_alloc_output_context2(&f, of, nullptr, partial_.c_str()); err < 0)
    fail_av("cannot set up the " + std::string(of->name) + " container", err);
  fmt_.reset(f);
  fmt_->flags |= AVFMT_FLAG_BITEXACT;
  open_encoder(w, h, fps);
  st_ = avformat_new_stream(f, nullptr);
  if (!st_) fail(path_ + ": out of memory adding a video stream");
  if (const int err = avcodec_parameters_from_context(st_->codecpar, enc_.get()); err < 0)
    fail_av("cannot copy the encoder's parameters", err);
  st_->time_base = enc_->time_base;
  st_->avg_frame_rate = enc_->framerate;
  if (const int err = avio_open(&f->pb, partial_.c_str(), AVIO_FLAG_WRITE); err < 0)
    fail_av("cannot create " + partial_, err);
  if (const int err = avformat_write_header(f, nullptr); err < 0) fail_av("cannot write the header", err);
  sws_.reset(sws_getContext(w, h, AV_PIX_FMT_RGB24, w, h, AV_PIX_FMT_YUV420P, SWS_BICUBIC, nullptr, nullptr,
                            nullptr));
  if (!sws_) fail(path_ + ": cannot set up the RGB to YUV conversion");
  yuv_->format = AV_PIX_FMT_YUV420P;
  yuv_->width = w;
  yuv_->height = h;
  if (const int err = av_frame_get_buffer(yuv_.get(), 0); err < 0) fail_av("cannot allocate a frame", err);
}

void ClipWriter::open_encoder(int w, int h, double fps) {
  const AVCodec* codec = avcodec_find_encoder_by_name(encoder_.c_str());
  if (!codec || codec->type != AVMEDIA_TYPE_VIDEO)
    fail(path_ + ": cannot write video: this libavcodec has no video encoder '" + encoder_ + "'");
  if (avformat_query_codec(fmt_->oformat, codec->id, FF_COMPLIANCE_NORMAL) == 0)
    fail(path_ + ": cannot write video: the " + fmt_->oformat->name + " container cannot hold " + codec->name);
  enc_.reset(avcodec_alloc_context3(codec));
  if (!enc_) fail(path_ + ": out of memory allocating the encoder");
  AVCodecContext* c = enc_.get();
  const AVRational rate = av_d2q(fps, 100000);
  c->width = w;
  c->height = h;
  c->pix_fmt = AV_PIX_FMT_YUV420P;
  c->framerate = rate;
  c->time_base = av_inv_q(rate);
  c->thread_count = 1;  // the same bytes on every machine
  c->flags |= AV_CODEC_FLAG_BITEXACT;
  c->colorspace = AVCOL_SPC_SMPTE170M;  // BT.601, limited range: libswscale's default both ways
  c->color_range = AVCOL_RANGE_MPEG;
  if (fmt_->oformat->flags & AVFMT_GLOBALHEADER) c->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  if (encoder_ == "libx264") {
    av_opt_set(c->priv_data, "crf", "16", 0);
    av_opt_set(c->priv_data, "preset", "veryfast", 0);  // 8 tiny frames: a slower preset saves nothing worth having
  } else {
    c->flags |= AV_CODEC_FLAG_QSCALE;
    c->global_quality = FF_QP2LAMBDA * 2;
  }
  if (const int err = avcodec_open2(c, codec, nullptr); err < 0)
    fail_av("cannot open the encoder for " + std::to_string(w) + "x" + std::to_string(h) + " yuv420p", err);
}

void ClipWriter::send(const AVFrame* f) {
  if (const int err = avcodec_send_frame(enc_.get(), f); err < 0) fail_av("cannot encode a frame", err);
  for (;;) {
    const int err = avcodec_receive_packet(enc_.get(), pkt_.get());
    if (err == AVERROR(EAGAIN) || err == AVERROR_EOF) return;
    if (err < 0) fail_av("cannot encode a frame", err);
    av_packet_rescale_ts(pkt_.get(), enc_->time_base, st_->time_base);
    pkt_->stream_index = st_->index;
    if (const int werr = av_interleaved_write_frame(fmt_.get(), pkt_.get()); werr < 0)
      fail_av("cannot write a packet", werr);
  }
}

void ClipWriter::add(const RgbImage& im, int64_t index) {
  if (const int err = av_frame_make_writable(yuv_.get()); err < 0) fail_av("cannot allocate a frame", err);
  const uint8_t* src[1] = {im.px.data()};
  const int stride[1] = {3 * im.w};
  sws_scale(sws_.get(), src, stride, 0, im.h, yuv_->data, yuv_->linesize);
  yuv_->pts = index;
  send(yuv_.get());
}

void ClipWriter::finish() {
  send(nullptr);
  if (const int err = av_write_trailer(fmt_.get()); err < 0) fail_av("cannot finish the file", err);
  if (const int err = avio_closep(&fmt_->pb); err < 0) fail_av("cannot close " + partial_, err);
  std::error_code ec;
  std::filesystem::rename(partial_, path_, ec);
  if (ec) fail(path_ + ": cannot rename " + partial_ + " to it: " + ec.message());
  done_ = true;
}

ClipWriter::~ClipWriter() {
  if (done_) return;
  fmt_.reset();  // closes the file
  std::error_code ec;
  std::filesystem::remove(partial_, ec);
}

}  // namespace

std::string default_video_encoder() { return avcodec_find_encoder_by_name("libx264") ? "libx264" : "mpeg4"; }

std::string encode_video(const std::string& path, const std::vector<RgbImage>& frames, double fps,
                         const std::string& encoder) {
  if (frames.empty()) fail(path + ": cannot write video: no frames");
  if (!(fps > 0 && fps <= 1000)) fail(path + ": cannot write video: fps must be in (0, 1000], got " + std::to_string(fps));
  const int w = frames[0].w, h = frames[0].h;
  if (w <= 0 || h <= 0 || w % 2 || h % 2)
    fail(path + ": cannot write video: frames are " + std::to_string(w) + "x" + std::to_string(h) +
         "; yuv420p needs even sides");
  for (size_t i = 0; i < frames.size(); ++i)
    if (frames[i].w != w || frames[i].h != h || frames[i].px.size() != size_t(w) * size_t(h) * 3)
      fail(path + ": cannot write video: frame " + std::to_string(i) + " is " + std::to_string(frames[i].w) + "x" +
           std::to_string(frames[i].h) + " (" + std::to_string(frames[i].px.size()) + " bytes), frame 0 is " +
           std::to_string(w) + "x" + std::to_string(h));
  const std::string name = encoder.empty() ? default_video_encoder() : encoder;
  ClipWriter clip(path, name, w, h, fps);
  for (size_t i = 0; i < frames.size(); ++i) clip.add(frames[i], int64_t(i));
  clip.finish();
  return name;
}

}  // namespace q3vl

#else  // FFMPEG=0: built without FFmpeg's libraries

namespace q3vl {

std::string default_video_encoder() { return ""; }

std::string encode_video(const std::string& path, const std::vector<RgbImage>&, double, const std::string&) {
  fail(path + ": this q3vl was built without FFmpeg (make FFMPEG=0), so it cannot encode video files; build it "
       "with FFmpeg's libraries (make deps; make)");
}

}  // namespace q3vl

#endif  // Q3VL_FFMPEG
