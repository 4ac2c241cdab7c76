// What the video decoder and encoder (src/data/video_decode.cpp, video_encode.cpp) share of FFmpeg: its error text
// for q3vl's errors and owning pointers for its objects. Included only where Q3VL_FFMPEG is on.
//
// FFmpeg's log goes into a per-thread "last error" instead of stderr, and av_message adds it to av_strerror's text:
// "Invalid data found when processing input (moov atom not found)".
#pragma once
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libswscale/swscale.h>
}

#include <memory>
#include <string>

#include "q3vl/core/error.hpp"

namespace q3vl {

// Call before each FFmpeg operation whose failure is reported: installs the log hook once (unless the program chose
// a log level itself) and forgets this thread's last logged error.
void hook_libav_log();
// av_strerror(err), and the last error FFmpeg logged on this thread when it says more.
std::string av_message(int err);

struct CodecFree {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameFree {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketFree {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsFree {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};
using FramePtr = std::unique_ptr<AVFrame, FrameFree>;
using PacketPtr = std::unique_ptr<AVPacket, PacketFree>;

inline FramePtr new_frame() {
  FramePtr f(av_frame_alloc());
  if (!f) fail("video: out of memory allocating a frame");
  return f;
}

}  // namespace q3vl
