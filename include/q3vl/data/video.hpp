// Video decoding with FFmpeg's libraries (libavformat, libavcodec, libswscale): the data/ layer under the video
// processor (issue 31). It knows nothing of devices, sampling or resizing: it tells what a clip holds and gives the
// frames asked for, as 8-bit RGB. encode_video (at the end) does the reverse for `q3vl synth`'s clips and the tests.
//
//   VideoInfo info = probe_video("clip.mp4");                 // count, fps, duration, size after rotation
//   std::vector<RgbImage> f = decode_frames("clip.mp4", {0, 12, 24, 36});
//
//   VideoFile v("clip.mp4");                                 // the same, opening the file once
//   v.info(); v.frames({0, 12});
//
// Frame indices are presentation indices 0..frames-1: the n of `ffmpeg -vf select='eq(n\,K)'`, frames in the
// order the decoder gives them (by timestamp). decode_frames gives one image per index, in the order asked
// (repeats allowed); only the frames needed are decoded: it seeks to the keyframe before each run of wanted frames
// and decodes forward from there.
//
// The pixels are the ffmpeg command line's, byte for byte:
//   ffmpeg -i clip -vf "select='eq(n\,K)'" -vsync 0 -frames:v 1 -f rawvideo -pix_fmt rgb24 -
// that is libswscale with the CLI's default flags (bicubic) and the frame's own colour matrix and range, after
// the display-matrix rotation that ffmpeg's autorotate applies (90/180/270 degrees, and flips). Checked in
// tests/unit/test_video_decode.cpp on H.264 (mp4, mkv, ts, raw, 8/10-bit, 4:2:0/4:2:2/4:4:4, BT.709, full range,
// edit lists, variable frame rate, rotations, odd sizes), VP9 (with alt-ref frames) and VP8.
//
// Frames not wanted are not converted, and those no other frame refers to are not even decoded. Decoding runs on
// the calling thread; decode several videos at once for more speed. A stream whose frame size changes midway is
// refused (its frames could not be stacked into one video).
//
// VideoInfo.frames is the number of frames decoding gives, counted without decoding: the video packets the demuxer
// reads (less those the container marks to be discarded, as an mp4 edit list does). It equals `ffprobe
// -count_frames`' nb_read_frames, and the stream's nb_frames where an mp4 stores one (what transformers' PyAV
// loader reads; kept in nb_frames); webm and mkv store none, and a duration x fps product would be off for
// variable frame rate. Opening a file reads all its packets once (no decoding; milliseconds for a clip).
//
// Every failure throws q3vl::Error with the file's name (or the name given for bytes) and FFmpeg's own message
// (av_strerror, and the last error FFmpeg logged, which names the fault: "moov atom not found"):
// a missing, corrupt or truncated file, no video stream, a codec without a decoder, zero frames, frames over
// the caller's size limits (refused from the header, before anything is allocated), an index past the end.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "q3vl/data/image.hpp"

namespace q3vl {

struct VideoInfo {
  int64_t frames = 0;     // frame count (see above): frames() takes indices 0..frames-1
  int64_t nb_frames = 0;  // the count the container stores (mp4's nb_frames), 0 when it has none
  double fps = 0;         // average frame rate (the stream's avg_frame_rate; frames/duration when absent)
  double duration = 0;    // seconds (the stream's duration, else the container's, else frames/fps)
  int width = 0;          // frame size as decode_frames returns it: after rotation (90/270 swap the sides)
  int height = 0;
  int rotation = 0;       // clockwise degrees the frames are turned by to display them: 0, 90, 180 or 270
  std::string codec;      // FFmpeg's codec name: "h264", "vp9", ...; "image" for a list of frame images
};

// Refused before decoding anything. The defaults accept 8K video; a server passes its own budget.
struct VideoLimits {
  int max_side = 16384;               // either side, before rotation
  long max_pixels = 8192L * 8192;     // width * height of one frame
  int64_t max_frames = 1 << 20;       // frames in the clip (a sampler never asks for more than a few hundred)
};

// An open video: the container and the decoder stay open between calls. Not thread-safe; one per thread.
class VideoFile {
 public:
  explicit VideoFile(const std::string& path, const VideoLimits& limits = {});
  // From bytes in memory (a data: URL's payload); `name` stands for the file in error messages. The bytes are
  // not copied: they must outlive the VideoFile.
  VideoFile(std::string_view bytes, const std::string& name, const VideoLimits& limits = {});
  ~VideoFile();
  VideoFile(VideoFile&&) noexcept;
  VideoFile& operator=(VideoFile&&) noexcept;

  const VideoInfo& info() const;
  const std::string& name() const;
  // Frames at these presentation indices, as RGB (info().width x info().height), in the order asked.
  std::vector<RgbImage> frames(const std::vector<int64_t>& indices);
  // Frames the decoder has given since the file was opened, wanted or not: what seeking saves (tests, logs).
  int64_t frames_decoded() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

VideoInfo probe_video(const std::string& path, const VideoLimits& limits = {});
VideoInfo probe_video(std::string_view bytes, const std::string& name, const VideoLimits& limits = {});
std::vector<RgbImage> decode_frames(const std::string& path, const std::vector<int64_t>& indices,
                                    const VideoLimits& limits = {});
std::vector<RgbImage> decode_frames(std::string_view bytes, const std::string& name,
                                    const std::vector<int64_t>& indices, const VideoLimits& limits = {});

// A video given as a list of frame image files (qwen-vl-utils accepts this): each is decoded by load_image
// (JPEG or PNG, PIL's pixels). All frames must have the same size. fps is the caller's (qwen-vl-utils' default 2);
// frames = paths.size(), duration = frames / fps, codec "image", rotation 0.
VideoInfo probe_frame_list(const std::vector<std::string>& paths, double fps = 2.0);
std::vector<RgbImage> load_frame_list(const std::vector<std::string>& paths, const std::vector<int64_t>& indices);

// ---- encoding (src/data/video_encode.cpp): `q3vl synth`'s clips, and tests ----------------------------------
//
//   std::string enc = encode_video("clips/a.mp4", frames, 8.0);   // -> "libx264" (or "mpeg4" without it)
//
// Writes RGB frames (all one size, even sides: 4:2:0 needs them) as a video file at `fps` frames per second, each
// frame shown for 1/fps s; the container comes from the file name (.mp4, .mkv, .avi, ...). `encoder` names a
// libavcodec encoder ("libx264", "mpeg4", ...); empty: default_video_encoder(). The pixels become yuv420p with the
// BT.601 matrix in limited range (what the decoder assumes of untagged video too), at high quality (x264 CRF 16,
// MPEG-4 q 2): decoded frames are the originals within codec loss. Deterministic: the same frames give the same
// bytes (one thread, bit-exact flags). The file is written as path + ".partial" and renamed when complete. Returns
// the encoder used. Throws q3vl::Error naming the file and FFmpeg's message (no such folder, an unknown
// container or encoder, no frames, frames of different or odd sizes). Built with FFMPEG=0 it always throws.
std::string encode_video(const std::string& path, const std::vector<RgbImage>& frames, double fps,
                         const std::string& encoder = "");
// The encoder encode_video uses by default: H.264 ("libx264") when this libavcodec has it, else MPEG-4 part 2
// ("mpeg4", always built in). Empty when built without FFmpeg.
std::string default_video_encoder();

}  // namespace q3vl
