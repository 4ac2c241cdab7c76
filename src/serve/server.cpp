#include "q3vl/serve/server.hpp"

#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/data/video.hpp"
#include "q3vl/data/video_processor.hpp"
#include "q3vl/runtime/runtime.hpp"
#include "q3vl/runtime/stop.hpp"
#include "q3vl/serve/engine.hpp"

namespace q3vl {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A request the server refuses: HTTP status and the OpenAI error object's fields.
struct HttpError {
  int status;
  std::string message, type = "invalid_request_error", param, code;
};
[[noreturn]] void refuse(int status, const std::string& msg, const std::string& param = "") {
  throw HttpError{status, msg, status == 404 ? "not_found_error" : "invalid_request_error", param};
}

// Every JSON the server writes: a message may quote what a client sent (a path, a parser's last bytes), and a
// string that is not UTF-8 makes json::dump throw, outside any handler when httplib answers a 404 itself. Invalid
// bytes become U+FFFD.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// An exception's message ("internal error" for one that is not a std::exception).
std::string what_of(std::exception_ptr ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "internal error";
}

std::string error_body(const HttpError& e) {
  json err = {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return dump(json{{"error", err}});
}

// Whether an Authorization header is "Bearer <key>", in time that depends on the lengths only.
bool bearer_matches(const std::string& header, const std::string& key) {
  const std::string want = "Bearer " + key;
  unsigned diff = header.size() != want.size();
  for (size_t i = 0; i < want.size(); ++i) diff |= (unsigned char)want[i] ^ (unsigned char)(i < header.size() ? header[i] : 0);
  return diff == 0;
}

// The offset of the first byte of s that does not belong to well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF), or npos.
size_t utf8_error(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = (unsigned char)s[i];
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto b = (unsigned char)s[i + k];
      if ((b >> 6) != 2) return i;
      cp = cp << 6 | (b & 0x3f);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return i;
    i += n;
  }
  return std::string_view::npos;
}

// A request's image or video: its name in messages ("messages[0] video 1") and its file's bytes.
struct Media {
  std::string name, bytes;
};

std::string b64decode(std::string_view in, const std::string& name) {
  static const std::string chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve(in.size() * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=' || c == '\n' || c == '\r' || c == ' ') continue;
    const size_t v = chars.find(c == '-' ? '+' : c == '_' ? '/' : c);
    if (v == std::string::npos)
      refuse(400, name + ": the data URL's base64 payload has a character outside base64", "messages");
    acc = (acc << 6) | (uint32_t)v;
    if ((bits += 6) >= 8) out.push_back(char((acc >> (bits -= 8)) & 0xff));
  }
  return out;
}

// Whether the peer of a connection has closed it (a peek, without waiting).
bool peer_closed(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// ---- The HTTP front ----------------------------------------------------------------------------------------------
// cpp-httplib 0.11 gives a connection a pool thread from accept to close: a client trickling its head a byte a second
// holds one as long as it likes, and 130 of them starve /health (issue 33). httplib still parses and routes here, but
// a connection reaches a thread only with a whole request head in hand: one reader thread polls every connection that
// is between requests or inside a head, with a deadline for the head (serve.header_timeout) and one for idle
// keep-alive; the body must follow within serve.read_timeout of the head's first byte. GET /health and /metrics run on
// threads of their own, so a pool busy with long completions still answers them. A client address holds at most
// serve.max_client_connections: a new one closes its oldest connection that is waiting for a head (a slow client's,
// never a request's), or is refused with 429 when all are busy. Bytes read past a request (pipelining) stay with the
// connection for the next one, which httplib's per-request stream dropped.
class HttpFront : public httplib::Server {
 public:
  struct Limits {
    double header_timeout = 10, read_timeout = 30, keep_alive = 5;
    int per_client = 64, max_connections = 512, threads = 128;
  };
  explicit HttpFront(const Limits& l) : lim_(l) {
    // httplib's accept loop hands each socket to process_and_close_socket through its task queue: run at once (it
    // only registers the socket) rather than on a pool thread.
    struct Inline : httplib::TaskQueue {
      void enqueue(std::function<void()> fn) override { fn(); }
      void shutdown() override {}
    };
    new_task_queue = [] { return new Inline; };
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) fail(std::string("serve: pipe: ") + std::strerror(errno));
    pool_ = std::make_unique<httplib::ThreadPool>(size_t(l.threads));
    fast_ = std::make_unique<httplib::ThreadPool>(2);
    reader_ = std::thread([this] { reader_loop(); });
  }
  // After listen_after_bind has returned (Server::stop): the reader, then the pools, then every socket.
  ~HttpFront() override {
    stop_ = true;
    wake();
    reader_.join();
    pool_->shutdown();
    fast_->shutdown();
    for (auto& c : conns_) ::close(c->fd);
    ::close(wake_[0]), ::close(wake_[1]);
  }

 private:
  struct Conn {
    int fd = -1;
    std::string addr, buf;  // buf: bytes read and not yet parsed
    double t_open = 0, t_head = 0, t_idle = 0;  // t_head: first byte of the current head (0: none yet)
    bool busy = false;                          // on a worker thread
  };
  class Stream;
  bool process_and_close_socket(socket_t sock) override;
  void reader_loop();
  void serve(const std::shared_ptr<Conn>& c);
  void close_conn(const std::shared_ptr<Conn>& c, const char* why = nullptr);  // m_ held; why: a last 408 answer
  void wake() { [[maybe_unused]] ssize_t n = ::write(wake_[1], "w", 1); }

  Limits lim_;
  std::mutex m_;
  std::vector<std::shared_ptr<Conn>> conns_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::unique_ptr<httplib::ThreadPool> pool_, fast_;
  std::thread reader_;
};

// Set by a handler that answered before httplib read the request's body (the pre-routing refusals): the unread body
// would be parsed as the next request, so the connection closes after the answer.
thread_local bool t_close_after = false;
// The socket of the request this thread handles (httplib 0.11 does not tell a handler whether its client is still
// there; a handler peeks at it).
thread_local int t_fd = -1;

bool wait_fd(int fd, short events, double seconds) {
  pollfd p{fd, events, 0};
  return poll(&p, 1, std::max(0, int(seconds * 1000))) > 0 && (p.revents & events);
}

// One connection's bytes for httplib: buffered ones first, then the socket, each read under the request's deadline.
class HttpFront::Stream : public httplib::Stream {
 public:
  Stream(int fd, std::string buf, double deadline, double write_timeout)
      : fd_(fd), buf_(std::move(buf)), deadline_(deadline), write_timeout_(write_timeout) {}
  bool is_readable() const override { return off_ < buf_.size() || wait_fd(fd_, POLLIN, deadline_ - wall_seconds()); }
  bool is_writable() const override { return wait_fd(fd_, POLLOUT, write_timeout_) && !peer_closed(fd_); }
  ssize_t read(char* p, size_t n) override {
    if (off_ >= buf_.size()) {
      if (!wait_fd(fd_, POLLIN, deadline_ - wall_seconds())) return -1;
      buf_.resize(16384), off_ = 0;
      const ssize_t r = ::recv(fd_, buf_.data(), buf_.size(), 0);
      buf_.resize(std::max<ssize_t>(r, 0));
      if (r <= 0) return r < 0 ? -1 : 0;
    }
    n = std::min(n, buf_.size() - off_);
    std::memcpy(p, buf_.data() + off_, n);
    off_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* p, size_t n) override {
    size_t done = 0;
    while (done < n) {
      if (!wait_fd(fd_, POLLOUT, write_timeout_)) return -1;
      const ssize_t w = ::send(fd_, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && errno != EAGAIN && errno != EINTR) return -1;
      done += size_t(std::max<ssize_t>(w, 0));
    }
    return ssize_t(n);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }
  std::string leftover() const { return buf_.substr(std::min(off_, buf_.size())); }

 private:
  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t n = sizeof a;
    char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "0";
    if ((peer ? getpeername(fd_, (sockaddr*)&a, &n) : getsockname(fd_, (sockaddr*)&a, &n)) == 0)
      getnameinfo((sockaddr*)&a, n, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    ip = host, port = std::atoi(serv);
  }
  int fd_;
  std::string buf_;
  size_t off_ = 0;
  double deadline_, write_timeout_;
};

// A short answer written straight to the socket (the connection is closed after it).
void answer_and_close(int fd, int status, const std::string& message) {
  const std::string body = error_body({status, message});
  const char* text = status == 408 ? "Request Timeout" : status == 429 ? "Too Many Requests"
                     : status == 431 ? "Request Header Fields Too Large" : "Service Unavailable";
  const std::string head = "HTTP/1.1 " + std::to_string(status) + " " + text +
                           "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                           "\r\nConnection: close\r\n\r\n";
  [[maybe_unused]] ssize_t n = ::send(fd, (head + body).data(), head.size() + body.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(fd, SHUT_WR);
}

bool HttpFront::process_and_close_socket(socket_t sock) {
  std::string ip;
  int port = 0;
  Stream(sock, "", 0, 0).get_remote_ip_and_port(ip, port);
  const double now = wall_seconds();
  std::lock_guard<std::mutex> g(m_);
  if ((int)conns_.size() >= lim_.max_connections) {
    answer_and_close(sock, 503, "the server has serve.max_connections open connections; try again later");
    ::close(sock);
    return false;
  }
  std::shared_ptr<Conn> oldest;
  int mine = 0;
  for (const auto& c : conns_)
    if (c->addr == ip && (++mine, !c->busy) && (!oldest || c->t_open < oldest->t_open)) oldest = c;
  if (mine >= lim_.per_client) {
    if (!oldest) {
      answer_and_close(sock, 429, "this address has serve.max_client_connections requests open; try again later");
      ::close(sock);
      return false;
    }
    close_conn(oldest, "closed for a newer connection from this address (serve.max_client_connections)");
  }
  auto c = std::make_shared<Conn>();
  c->fd = sock, c->addr = ip, c->t_open = c->t_idle = now;
  conns_.push_back(c);
  wake();
  return true;
}

void HttpFront::close_conn(const std::shared_ptr<Conn>& c, const char* why) {
  if (why) answer_and_close(c->fd, 408, why);
  ::close(c->fd);
  std::erase(conns_, c);
}

void HttpFront::reader_loop() {
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Conn>> who;
  std::vector<char> tmp(16384);
  while (!stop_) {
    fds.assign(1, pollfd{wake_[0], POLLIN, 0});
    who.assign(1, nullptr);
    {
      std::lock_guard<std::mutex> g(m_);
      for (const auto& c : conns_)
        if (!c->busy) fds.push_back({c->fd, POLLIN, 0}), who.push_back(c);
    }
    poll(fds.data(), fds.size(), 100);
    char drain[64];
    while (::read(wake_[0], drain, sizeof drain) > 0) {
    }
    const double now = wall_seconds();
    std::lock_guard<std::mutex> g(m_);
    for (size_t i = 1; i < fds.size(); ++i) {
      const auto& c = who[i];
      if (c->busy || std::find(conns_.begin(), conns_.end(), c) == conns_.end()) continue;
      if (fds[i].revents) {
        const ssize_t n = ::recv(c->fd, tmp.data(), tmp.size(), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          close_conn(c);
          continue;
        }
        if (n > 0 && c->buf.empty()) c->t_head = now;
        if (n > 0) c->buf.append(tmp.data(), size_t(n));
      }
      if (c->buf.find("\r\n\r\n") != std::string::npos) {  // a whole head: to a worker
        c->busy = true;
        const bool quick = c->buf.rfind("GET /health", 0) == 0 || c->buf.rfind("GET /metrics", 0) == 0;
        (quick ? fast_ : pool_)->enqueue([this, c] { serve(c); });
      } else if (c->buf.size() > 65536) {
        answer_and_close(c->fd, 431, "the request head is larger than 64 KiB");
        close_conn(c);
      } else if (c->t_head > 0 && now - c->t_head > lim_.header_timeout) {
        close_conn(c, "the request head did not arrive in time (serve.header_timeout)");
      } else if (c->t_head == 0 && now - c->t_idle > lim_.keep_alive) {
        close_conn(c);
      }
    }
  }
}

void HttpFront::serve(const std::shared_ptr<Conn>& c) {
  Stream strm(c->fd, std::move(c->buf), c->t_head + lim_.read_timeout, lim_.read_timeout);
  bool closed = false, ok = false;
  t_close_after = false, t_fd = c->fd;
  try {
    ok = process_request(strm, stop_, closed, nullptr);
    closed |= t_close_after;
  } catch (...) {  // httplib catches a handler's; anything else ends the connection, not the server
  }
  std::lock_guard<std::mutex> g(m_);
  c->buf = strm.leftover();
  c->t_idle = wall_seconds();
  c->t_head = c->buf.empty() ? 0 : c->t_idle;  // pipelined: the next head has begun
  c->busy = false;
  if (!ok || closed || stop_) close_conn(c);
  wake();
}

class Server {
 public:
  explicit Server(const Deck& d) : deck_(d) {}
  int run();

 private:
  // HTTP side.
  void handle_completion(const httplib::Request& req, httplib::Response& res, bool chat);
  std::shared_ptr<Job> parse_request(const json& body, bool chat);
  std::optional<int64_t> request_fields(const json& body, Job& job);
  GenPrompt chat_prompt(const json& body);
  GenPrompt text_prompt(const json& body);
  std::string media_bytes(const json& field, const std::string& type, const std::string& name);
  std::string read_media_file(const std::string& path, const std::string& name);
  std::vector<RgbImage> decode_images(const std::vector<Media>& images, int64_t& tokens);
  std::vector<VideoClip> decode_videos(const std::vector<Media>& videos, int64_t& tokens);
  void reply_stream(const std::shared_ptr<Job>& job, const httplib::Request& req, httplib::Response& res, bool chat);
  json envelope(bool chat, bool chunk);
  json response_object(const Job& job, bool chat);
  std::string metrics_text();
  void configure();
  void routes(HttpFront& svr);
  void guards(HttpFront& svr, const std::string& host);

  const Deck& deck_;
  std::unique_ptr<Tokenizer> tok_;
  ImageConfig icfg_;
  VideoConfig vcfg_;  // video.* (generate's sampling and resizing), the model's patch sizes
  SamplingParams base_;
  std::string model_name_, image_dir_;
  int64_t max_context_ = 0, max_tokens_ = 0;
  int64_t max_image_pixels_ = 0, max_body_ = 0;  // serve.max_image_pixels; serve.max_body_mib in bytes
  std::atomic<int64_t> next_id_{1};
  double created_ = 0;
  Engine engine_{deck_, serve_config(deck_)};
  Metrics& metrics_ = engine_.metrics;
  Scheduler& sched_ = engine_.scheduler;
};

// A request as a job for the engine: its sampling fields, then its prompt (chat messages, or a completion's text),
// which must leave room for an answer in serve.max_context and fit the KV cache with max_tokens.
std::shared_ptr<Job> Server::parse_request(const json& body, bool chat) {
  if (!body.is_object()) refuse(400, "the request body must be a JSON object");
  auto job = std::make_shared<Job>();
  const std::optional<int64_t> mt = request_fields(body, *job);
  job->prompt = chat ? chat_prompt(body) : text_prompt(body);
  const int64_t n = (int64_t)job->prompt.ids.size();
  if (n >= max_context_)
    refuse(413, "the prompt has " + std::to_string(n) + " tokens; this server's context is " +
                    std::to_string(max_context_) + " tokens (serve.max_context)", chat ? "messages" : "prompt");
  job->sp.max_new_tokens = (int)std::min<int64_t>(mt.value_or(max_tokens_), max_context_ - n);
  const KvCache& kv = engine_.blocks.cache();
  const int64_t blocks = kv.blocks_for(n + job->sp.max_new_tokens);
  if (blocks > kv.max_blocks)
    refuse(413, "the prompt and max_tokens need " + std::to_string(blocks) + " KV-cache blocks; the whole cache has " +
                    std::to_string(kv.max_blocks) + " (serve.kv_mib)", "max_tokens");
  return job;
}

// The fields besides the prompt, typed (a wrong type is the client's mistake, named in the message): the model, the
// sampling (the model's defaults, a random seed unless given), streaming and stop strings. Returns max_tokens (or
// max_completion_tokens) when given.
std::optional<int64_t> Server::request_fields(const json& body, Job& job) {
  job.sp = base_;
  auto num = [&](const char* key, double lo, double hi, bool integer) -> std::optional<double> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    const json& v = body[key];
    if (!v.is_number() || (integer && !v.is_number_integer()))
      refuse(400, std::string("'") + key + "' must be " + (integer ? "an integer" : "a number"), key);
    const double x = v.get<double>();
    if (x < lo || x > hi)
      refuse(400, std::string("'") + key + "' = " + v.dump() + " is outside [" + json(lo).dump() + ", " +
                      json(hi).dump() + "]", key);
    return x;
  };
  if (body.contains("model") && !body["model"].is_string()) refuse(400, "'model' must be a string", "model");
  if (body.contains("model") && body["model"] != model_name_)
    refuse(404, "the model '" + body["model"].get<std::string>() + "' does not exist; this server serves '" +
                    model_name_ + "'", "model");
  if (auto n = num("n", 1, 1e9, true); n && *n != 1) refuse(400, "only n = 1 is supported", "n");
  if (auto t = num("temperature", 0, 2, false)) job.sp.temperature = *t;
  if (auto p = num("top_p", 0, 1, false)) {
    if (*p <= 0) refuse(400, "'top_p' must be greater than 0", "top_p");
    job.sp.top_p = *p;
  }
  if (auto k = num("top_k", -1, 1e9, true)) job.sp.top_k = std::max(0, (int)*k);  // -1 (vLLM) and 0: all
  std::optional<double> mt = num("max_tokens", 1, 1e9, true);
  if (auto m2 = num("max_completion_tokens", 1, 1e9, true)) mt = m2;
  job.sp.seed = std::random_device()();
  if (num("seed", -9.2e18, 9.2e18, true)) job.sp.seed = (uint64_t)body["seed"].get<int64_t>();
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean()) refuse(400, "'stream' must be true or false", "stream");
    job.stream = body["stream"].get<bool>();
  }
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object() || (so.contains("include_usage") && !so["include_usage"].is_boolean()))
      refuse(400, "'stream_options' must be an object with a boolean 'include_usage'", "stream_options");
    job.include_usage = so.value("include_usage", false);
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& s = body["stop"];
    if (s.is_string()) job.stops.push_back(s.get<std::string>());
    else if (s.is_array() && s.size() <= 4 &&
             std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); }))
      for (const json& x : s) job.stops.push_back(x.get<std::string>());
    else refuse(400, "'stop' must be a string or an array of at most 4 strings", "stop");
    std::erase_if(job.stops, [](const std::string& x) { return x.empty(); });
  }
  return mt ? std::optional<int64_t>((int64_t)*mt) : std::nullopt;
}

// A chat's messages as the training-data record format of data/chat.hpp, each image and video named by its part
// ("messages[0] video 1"): parse_record then checks roles and order exactly as for generate. The images and videos
// are decoded once all are known (their cost checked first), then templated with the text.
GenPrompt Server::chat_prompt(const json& body) {
  if (!body.contains("messages")) refuse(400, "'messages' is required", "messages");
  const json& msgs = body["messages"];
  if (!msgs.is_array() || msgs.empty()) refuse(400, "'messages' must be a non-empty array", "messages");
  json rec = {{"messages", json::array()}};
  std::vector<Media> images, videos;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& m = msgs[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      refuse(400, where + " must be an object with a string 'role'", "messages");
    json content = json::array();
    const json c = m.value("content", json());
    if (c.is_string()) {
      content.push_back({{"type", "text"}, {"text", c}});
    } else if (c.is_array()) {
      for (const json& part : c) {
        const json t = part.is_object() ? part.value("type", json()) : json();
        const std::string type = t.is_string() ? t.get<std::string>() : "";
        if (type == "text" && part.contains("text") && part["text"].is_string()) {
          content.push_back({{"type", "text"}, {"text", part["text"]}});
        } else if ((type == "image_url" || type == "video_url") && part.contains(type)) {
          const bool video = type == "video_url";
          std::vector<Media>& list = video ? videos : images;
          const std::string name = where + (video ? " video " : " image ") + std::to_string(list.size() + 1);
          list.push_back({name, media_bytes(part[type], type, name)});
          content.push_back({{"type", video ? "video" : "image"}, {video ? "video" : "image", name}});
        } else {
          refuse(400, where + ": a content part must be {\"type\": \"text\", \"text\": ...}, {\"type\": "
                          "\"image_url\", \"image_url\": {\"url\": ...}} or {\"type\": \"video_url\", "
                          "\"video_url\": {\"url\": ...}}", "messages");
        }
      }
    } else if (!c.is_null()) {
      refuse(400, where + ": 'content' must be a string or an array of parts", "messages");
    }
    rec["messages"].push_back({{"role", m["role"]}, {"content", content}});
  }
  if (rec["messages"].back()["role"] == "assistant")
    refuse(400, "the last message is the assistant's: there is nothing to answer", "messages");
  int64_t visual = 0;  // the tokens the images and videos become, checked against serve.max_context as they come
  const std::vector<RgbImage> pictures = decode_images(images, visual);
  const std::vector<VideoClip> clips = decode_videos(videos, visual);
  try {
    const Conversation conv = parse_record(rec, "request", 0);
    return encode_prompt(conv, pictures, *tok_, icfg_, clips, vcfg_);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind("request:0: ", 0) == 0) msg = msg.substr(11);
    refuse(msg.find("image '") != std::string::npos ? 422 : 400, msg, "messages");
  }
}

// A completion's prompt: a string (or an array of one), tokenized as it is.
GenPrompt Server::text_prompt(const json& body) {
  if (!body.contains("prompt")) refuse(400, "'prompt' is required", "prompt");
  json p = body["prompt"];
  if (p.is_array() && p.size() == 1 && p[0].is_string()) p = p[0];
  if (!p.is_string()) refuse(400, "'prompt' must be a string (or an array of one string)", "prompt");
  GenPrompt g;
  for (int32_t id : tok_->encode(p.get<std::string>())) g.ids.push_back(id);
  if (g.ids.empty()) refuse(400, "'prompt' is empty", "prompt");
  return g;
}

// An image_url's or video_url's file (type: the part's type; field: its value, {"url": ...} or the URL itself): a
// data: URL's payload (a video's MIME type video/*), or a file under serve.image_dir. Decoded later (decode_images,
// decode_videos), once the sizes of all a request's images and videos are known. Remote URLs are refused, as vLLM
// refuses them unless told otherwise.
std::string Server::media_bytes(const json& field, const std::string& type, const std::string& name) {
  const json u = field.is_object() ? field.value("url", json()) : field;
  if (!u.is_string()) refuse(400, name + ": '" + type + ".url' must be a string", "messages");
  const std::string url = u.get<std::string>();
  const bool video = type == "video_url";
  const std::string kind = video ? "video" : "image";
  if (url.rfind("data:", 0) == 0) {
    const size_t comma = url.find(',');
    const std::string head = url.substr(5, comma == std::string::npos ? 0 : comma - 5);
    if (comma == std::string::npos || head.find(";base64") == std::string::npos)
      refuse(400, name + ": a data URL must be data:<type>;base64,<payload>", "messages");
    const std::string mime = head.substr(0, head.find(';'));
    if (video && mime.rfind("video/", 0) != 0 && mime != "application/octet-stream")
      refuse(400, name + ": a video_url's data URL must be data:video/<type>;base64,<payload>, not data:" + mime,
             "messages");
    return b64decode(std::string_view(url).substr(comma + 1), name);
  }
  if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0)
    refuse(400, name + ": remote " + kind + " URLs are not fetched by this server; send the " +
                    (video ? "clip" : "picture") + " as a data: URL (or a path under the folder serve.image_dir names)",
           "messages");
  const std::string path = url.rfind("file://", 0) == 0 ? url.substr(7) : url;
  if (image_dir_.empty())
    refuse(400, name + ": local " + kind + " paths are off (set serve.image_dir to allow a folder); send a data: URL",
           "messages");
  return read_media_file(path, name);
}

// The file is opened first and judged by what was opened: the kernel's name for the descriptor (links and ".."
// resolved, whatever the path said) must lie inside serve.image_dir. Checking a path and then opening it would let a
// link swapped in between, or one after a missing component (weakly_canonical stops resolving there), escape. A file
// outside, missing, unreadable or not a regular file gets the same 400: the answer tells nothing about what exists
// outside the folder.
std::string Server::read_media_file(const std::string& path, const std::string& name) {
  std::error_code ec;
  const fs::path root = fs::canonical(image_dir_, ec);
  const fs::path p = fs::path(path).is_absolute() ? fs::path(path) : root / path;
  auto refused = [&]() { refuse(400, name + ": '" + path + "' is not a readable file under serve.image_dir", "messages"); };
  // O_NONBLOCK: a FIFO must not hang the handler in open().
  const int fd = ec ? -1 : ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) refused();
  std::string bytes;
  bool inside = false;
  struct stat st {};
  {
    std::error_code e2;
    const fs::path real = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), e2);
    const std::string r = root.string() == "/" ? "/" : root.string() + "/";
    inside = !e2 && real.string().rfind(r, 0) == 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  }
  if (inside && st.st_size > max_body_) {
    ::close(fd);
    refuse(413, name + ": '" + path + "' is " + std::to_string(st.st_size) + " bytes, more than a request body may "
                "be (serve.max_body_mib)", "messages");
  }
  if (inside) {
    bytes.resize((size_t)st.st_size);
    size_t got = 0;
    for (ssize_t n; got < bytes.size() && (n = ::read(fd, bytes.data() + got, bytes.size() - got)) > 0;) got += n;
    bytes.resize(got);
  }
  ::close(fd);
  if (!inside) refused();
  return bytes;
}

// Decodes a request's images after checking, from their headers alone, what they would cost: the image tokens they
// become (smart_resize's size) must leave room in serve.max_context, and the pixels decoded for all of them must
// stay within serve.max_image_pixels. A JPEG larger than that is decoded at 1/2, 1/4 or 1/8 (libjpeg's scaled IDCT),
// never below the size the model sees; a PNG cannot be, and is refused. A decompression bomb (a small file of a huge
// image) is thus refused before a pixel is decoded.
std::vector<RgbImage> Server::decode_images(const std::vector<Media>& images, int64_t& tokens) {
  std::vector<int> scale(images.size(), 1);
  int64_t pixels = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    const std::string& name = images[i].name;
    const std::string& bytes = images[i].bytes;
    try {
      const ImageHeader h = read_image_header((const uint8_t*)bytes.data(), bytes.size(), name);
      if (h.w <= 0 || h.h <= 0 || h.w > INT32_MAX || h.h > INT32_MAX)
        fail(name + ": image has no pixels or is too large (" + std::to_string(h.w) + "x" + std::to_string(h.h) + ")");
      const auto [th, tw] = smart_resize((int)h.h, (int)h.w, icfg_.factor(), icfg_.min_pixels, icfg_.max_pixels, name);
      tokens += int64_t(th) * tw / (int64_t(icfg_.factor()) * icfg_.factor()) + 2;  // + vision start and end
      if (tokens >= max_context_)
        refuse(413, name + " is " + std::to_string(h.w) + "x" + std::to_string(h.h) + ": the images so far become " +
                        std::to_string(tokens) + " tokens; this server's context is " + std::to_string(max_context_) +
                        " tokens (serve.max_context; serve.max_pixels sets an image's size)", "messages");
      const int64_t left = max_image_pixels_ - pixels;
      auto side = [](long n, int s) { return (n + s - 1) / s; };
      while (h.w * h.h / (int64_t(scale[i]) * scale[i]) > left && h.jpeg && scale[i] < 8 &&
             side(h.w, scale[i] * 2) >= tw && side(h.h, scale[i] * 2) >= th)
        scale[i] *= 2;
      const int64_t px = int64_t(side(h.w, scale[i])) * side(h.h, scale[i]);
      if (px > left)
        refuse(413, name + " is " + std::to_string(h.w) + "x" + std::to_string(h.h) + " (" + std::to_string(px) +
                        " pixels decoded" + (h.jpeg ? " at the smallest scale the model's size allows" : "") +
                        "); this request's images may decode to " + std::to_string(max_image_pixels_) +
                        " pixels in all (serve.max_image_pixels)", "messages");
      pixels += px;
    } catch (const Error& e) {
      refuse(422, e.what(), "messages");
    }
  }
  std::vector<RgbImage> out;
  for (size_t i = 0; i < images.size(); ++i) try {
      out.push_back(decode_image((const uint8_t*)images[i].bytes.data(), images[i].bytes.size(), images[i].name,
                                 scale[i]));
    } catch (const Error& e) {
      refuse(422, e.what(), "messages");
    }
  return out;
}

// Decodes a request's videos from their bytes (FFmpeg, only the sampled frames), sampled and resized as generate does
// (video.*: fps, min/max frames, the clip's pixel budget). What a clip costs is known from its header before a frame
// is decoded: a frame over serve.max_image_pixels (or 16384 on a side) is refused, and the tokens its sampled frames
// become, added to `tokens` (the request's images before it), must leave room in serve.max_context (413 naming the
// count). Frames are decoded a few at a time and resized at once, so a long clip never holds all its full-size
// frames. Any fault of the file (corrupt, truncated, no video stream, a codec without a decoder, no frames) is a 422
// naming the part, with FFmpeg's reason.
std::vector<VideoClip> Server::decode_videos(const std::vector<Media>& videos, int64_t& tokens) {
  VideoLimits lim;
  lim.max_pixels = std::min<long>(lim.max_pixels, long(max_image_pixels_));
  std::vector<VideoClip> clips;
  for (const Media& v : videos) try {
      VideoFile file(std::string_view(v.bytes), v.name, lim);
      const VideoInfo& info = file.info();
      const int64_t n = (int64_t)sample_frame_indices(info.frames, info.fps, vcfg_, v.name).size();
      const auto [th, tw] = video_smart_resize(int(n), info.height, info.width, vcfg_, v.name);
      const int64_t f = vcfg_.factor(), patches = (n + vcfg_.temporal_patch - 1) / vcfg_.temporal_patch;
      const int64_t own = patches * (int64_t(th / f) * (tw / f));
      tokens += own + 2 * patches;  // + each temporal patch's vision start and end (its timestamp text uncounted)
      if (tokens >= max_context_)
        refuse(413, v.name + ": " + std::to_string(n) + " frames sampled (of " + std::to_string(info.frames) + ", " +
                        std::to_string(info.width) + "x" + std::to_string(info.height) + " resized to " +
                        std::to_string(tw) + "x" + std::to_string(th) + ") become " + std::to_string(own) +
                        " video tokens, " + std::to_string(tokens) + " with the request's images and videos so far; "
                        "this server's context is " + std::to_string(max_context_) + " tokens (serve.max_context; "
                        "video.fps, video.max_frames and video.max_pixels set a clip's size)", "messages");
      clips.push_back(sample_clip(file, vcfg_, v.name));
    } catch (const Error& e) {
      refuse(422, e.what(), "messages");
    }
  return clips;
}

// An answer object's fields besides the choices: its id (a new one for each answer), kind, time and model.
json Server::envelope(bool chat, bool chunk) {
  return {{"id", (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_++)},
          {"object", !chat ? "text_completion" : chunk ? "chat.completion.chunk" : "chat.completion"},
          {"created", (int64_t)created_},
          {"model", model_name_}};
}

json usage(const Job& job, int64_t completion) {
  const int64_t prompt = (int64_t)job.prompt.ids.size();
  return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

json Server::response_object(const Job& job, bool chat) {
  json choice = {{"index", 0}, {"finish_reason", job.finish}, {"logprobs", nullptr}};
  if (chat) choice["message"] = {{"role", "assistant"}, {"content", job.text}};
  else choice["text"] = job.text;
  json o = envelope(chat, false);
  o["choices"] = json::array({choice});
  o["usage"] = usage(job, job.completion_tokens);
  return o;
}

void Server::handle_completion(const httplib::Request& req, httplib::Response& res, bool chat) {
  metrics_.requests++;
  std::shared_ptr<Job> job;
  try {
    json body;
    if (const size_t bad = utf8_error(req.body); bad != std::string::npos)
      refuse(400, "the request body is not valid UTF-8 (byte " + std::to_string(bad) + ")");
    try {
      body = json::parse(req.body);
    } catch (const json::exception& e) {
      refuse(400, std::string("malformed JSON in the request body: ") + e.what());
    }
    job = parse_request(body, chat);
  } catch (const HttpError& e) {
    metrics_.errors++;
    res.status = e.status;
    res.set_content(error_body(e), "application/json");
    return;
  }
  job->t_arrival = wall_seconds();
  metrics_.prompt_tokens += (int64_t)job->prompt.ids.size();
  sched_.submit(job);
  if (job->stream) return reply_stream(job, req, res, chat);
  // A client that leaves before its answer cancels the request, as a stream's does.
  const int fd = t_fd;
  std::unique_lock<std::mutex> l(job->m);
  while (!job->cv.wait_for(l, std::chrono::milliseconds(100), [&] { return job->done; }))
    if (fd >= 0 && peer_closed(fd)) {
      job->cancelled = true;
      sched_.wake();
      res.status = 499;  // nobody reads it
      return;
    }
  if (!job->error.empty()) {
    res.status = job->status;
    res.set_content(error_body({job->status, job->error, "server_error"}), "application/json");
    return;
  }
  res.set_content(dump(response_object(*job, chat)), "application/json");
}

void Server::reply_stream(const std::shared_ptr<Job>& job, const httplib::Request& req, httplib::Response& res,
                          bool chat) {
  const json head = envelope(chat, true);  // every chunk's
  auto sent = std::make_shared<size_t>(0);
  auto started = std::make_shared<bool>(false);
  auto chunk = [head, chat](const json& delta_or_text, const json& finish) {
    json c = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
    if (chat) c["delta"] = delta_or_text;
    else c["text"] = delta_or_text;
    json o = head;
    o["choices"] = json::array({c});
    return "data: " + dump(o) + "\n\n";
  };
  res.set_header("Cache-Control", "no-cache");
  // HTTP/1.0 has no chunked encoding: the stream ends where the connection does.
  const bool http10 = req.version == "HTTP/1.0";
  if (http10) res.set_header("Connection", "close");
  using Provide = void (httplib::Response::*)(const std::string&, httplib::ContentProviderWithoutLength,
                                              httplib::ContentProviderResourceReleaser);
  const Provide provide = http10 ? static_cast<Provide>(&httplib::Response::set_content_provider)
                                 : &httplib::Response::set_chunked_content_provider;
  (res.*provide)(
      "text/event-stream",
      [job, head, sent, started, chunk, chat](size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) {
          if (!sink.write(s.data(), s.size())) {
            job->cancelled = true;  // the client went away: the engine frees its sequence
            return false;
          }
          return true;
        };
        if (!*started && chat) {
          *started = true;
          if (!write(chunk({{"role", "assistant"}, {"content", ""}}, nullptr))) return false;
        }
        std::string delta, finish, error;
        bool done;
        int64_t ct;
        {
          std::unique_lock<std::mutex> l(job->m);
          job->cv.wait_for(l, std::chrono::milliseconds(200), [&] { return job->done || job->text.size() > *sent; });
          delta = job->text.substr(*sent);
          *sent = job->text.size();
          done = job->done, finish = job->finish, error = job->error, ct = job->completion_tokens;
        }
        if (!done && delta.empty() && !sink.is_writable()) {
          job->cancelled = true;
          return false;
        }
        if (!delta.empty() && !write(chunk(chat ? json{{"content", delta}} : json(delta), nullptr))) return false;
        if (!done) return true;
        if (!error.empty()) {
          write("data: " + error_body({job->status, error, "server_error"}) + "\n\n");
        } else {
          write(chunk(chat ? json::object() : json(""), finish));
          if (job->include_usage) {
            json o = head;
            o["choices"] = json::array(), o["usage"] = usage(*job, ct);
            write("data: " + dump(o) + "\n\n");
          }
        }
        write("data: [DONE]\n\n");
        sink.done();
        return true;
      },
      [job](bool success) {
        if (!success) job->cancelled = true;
      });
}

std::string Server::metrics_text() {
  std::ostringstream o;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n" << name << " " << v << "\n";
  };
  metric("q3vl_requests_total", "counter", "completion requests received", (double)metrics_.requests);
  metric("q3vl_request_errors_total", "counter", "requests refused with a 4xx error", (double)metrics_.errors);
  metric("q3vl_prompt_tokens_total", "counter", "prompt tokens of accepted requests", (double)metrics_.prompt_tokens);
  metric("q3vl_generation_tokens_total", "counter", "tokens generated", (double)metrics_.completion_tokens);
  metric("q3vl_queue_length", "gauge", "requests waiting for admission", (double)metrics_.queue);
  metric("q3vl_batch_size", "gauge", "sequences in the running batch", (double)metrics_.running);
  metric("q3vl_kv_blocks_used", "gauge", "KV-cache blocks in use", (double)metrics_.kv_used);
  metric("q3vl_kv_blocks_total", "gauge", "KV-cache blocks", (double)metrics_.kv_total);
  metric("q3vl_engine_steps_total", "counter", "batched model steps", (double)metrics_.steps);
  metric("q3vl_prefill_tokens_total", "counter", "prompt tokens computed (not taken from the prefix cache)",
         (double)metrics_.prefill_tokens);
  metric("q3vl_step_prompt_budget", "gauge", "prompt tokens the last step could carry (serve.max_tpot_ms sizes it)",
         (double)metrics_.step_prompt_budget);
  metric("q3vl_prefix_cache_hit_tokens_total", "counter", "prompt tokens whose KV blocks came from the prefix cache",
         (double)metrics_.prefix_hit_tokens);
  metric("q3vl_prefix_cache_blocks", "gauge", "KV-cache blocks kept by the prefix cache (shared or evictable)",
         (double)metrics_.prefix_blocks);
  metric("q3vl_prefix_cache_evicted_blocks_total", "counter", "cached blocks freed for new requests",
         (double)metrics_.evicted);
  metric("q3vl_requests_cancelled_total", "counter", "requests whose client left before the answer",
         (double)metrics_.cancelled);
  metric("q3vl_requests_timed_out_total", "counter", "requests past serve.timeout (queued: 503; running: cut short)",
         (double)metrics_.timed_out);
  metric("q3vl_engine_decode_steps_total", "counter", "steps that brought decoding sequences a token and no prompt",
         (double)metrics_.decode_steps);
  metric("q3vl_engine_decode_step_rows_total", "counter", "sequences in those steps", (double)metrics_.decode_rows);
  metric("q3vl_engine_decode_step_seconds_total", "counter", "wall time of those steps", metrics_.decode_s.load());
  metric("q3vl_engine_mixed_steps_total", "counter", "steps that carried prompt chunks (and any decodes)",
         (double)metrics_.mixed_steps);
  metric("q3vl_engine_mixed_step_rows_total", "counter", "segments in those steps", (double)metrics_.mixed_rows);
  metric("q3vl_engine_mixed_step_seconds_total", "counter", "wall time of those steps", metrics_.mixed_s.load());
  metric("q3vl_engine_vision_encodes_total", "counter", "requests whose images and videos went through the vision "
         "tower at admission", (double)metrics_.vision_encodes);
  metric("q3vl_engine_vision_passes_total", "counter", "passes of the vision tower for them (serve.vision_batch)",
         (double)metrics_.vision_passes);
  metric("q3vl_engine_vision_seconds_total", "counter", "wall time of those passes", metrics_.vision_s.load());
  metric("q3vl_engine_busy_seconds_total", "counter",
         "wall time of scheduler ticks that had work (steps, encodes, scheduling, sampling, streaming)",
         metrics_.busy_s.load());
  std::lock_guard<std::mutex> g(metrics_.m);
  o << "# HELP q3vl_time_to_first_token_seconds arrival to first generated token\n"
       "# TYPE q3vl_time_to_first_token_seconds summary\n"
    << "q3vl_time_to_first_token_seconds_sum " << metrics_.ttft_sum << "\nq3vl_time_to_first_token_seconds_count "
    << metrics_.ttft_n << "\n";
  o << "# HELP q3vl_time_per_output_token_seconds time per generated token after the first\n"
       "# TYPE q3vl_time_per_output_token_seconds summary\n"
    << "q3vl_time_per_output_token_seconds_sum " << metrics_.tpot_sum
    << "\nq3vl_time_per_output_token_seconds_count " << metrics_.tpot_n << "\n";
  return o.str();
}

namespace {
// cpp-httplib listens with a backlog of 5, compiled into Debian's library: 32 clients connecting at once overflow it,
// and some network stacks answer the overflow with a reset ("Connection reset by peer" at the start of a request,
// seen on the GPU machine). listen() again on the bound socket, found among this process's descriptors, widens it.
void widen_backlog(int port) {
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(e.path().filename().c_str());
    int on = 0;
    socklen_t n = sizeof on;
    sockaddr_storage a{};
    socklen_t an = sizeof a;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &n) != 0 || !on) continue;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &an) != 0) continue;
    const int p = a.ss_family == AF_INET    ? ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port)
                  : a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                            : -1;
    if (p == port && ::listen(fd, SOMAXCONN) != 0)
      log_warn(std::string("serve: could not widen the listen backlog: ") + std::strerror(errno));
  }
}

}  // namespace

// What the HTTP side needs from the deck and the loaded model: the tokenizer, image and video processing, the model's
// sampling defaults, the limits on requests, and the model's name for clients.
void Server::configure() {
  const ModelConfig& cfg = engine_.runner.config();
  tok_ = std::make_unique<Tokenizer>(load_tokenizer(deck_, "serve"));
  icfg_ = image_config(deck_, "serve", cfg);
  vcfg_ = video_config(deck_, cfg);
  base_ = model_sampling(cfg, *tok_);
  sched_.configure(engine_.config, tok_.get(), base_);
  max_context_ = deck_.integer("serve.max_context");
  max_tokens_ = deck_.integer("serve.max_tokens");
  image_dir_ = deck_.str("serve.image_dir");
  max_image_pixels_ = deck_.integer("serve.max_image_pixels");
  max_body_ = (int64_t)(deck_.real("serve.max_body_mib") * 1048576.0);
  model_name_ = deck_.str("serve.model_name");
  if (model_name_.empty()) {
    const std::string from = !deck_.str("model.hf").empty() ? deck_.str("model.hf") : engine_.runner.checkpoint();
    model_name_ = from.empty() ? "q3vl-" + deck_.str("model.preset") : fs::path(from).filename().string();
    if (model_name_.empty()) model_name_ = fs::path(from).parent_path().filename().string();
  }
}

void Server::routes(HttpFront& svr) {
  using Req = httplib::Request;
  using Res = httplib::Response;
  svr.Post("/v1/chat/completions", [this](const Req& q, Res& r) { handle_completion(q, r, true); });
  svr.Post("/v1/completions", [this](const Req& q, Res& r) { handle_completion(q, r, false); });
  svr.Get("/v1/models", [this](const Req&, Res& r) {
    json m = {{"id", model_name_}, {"object", "model"}, {"created", (int64_t)created_}, {"owned_by", "q3vl"},
              {"max_model_len", max_context_}};
    r.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  // Unhealthy (503) once the engine has stopped, or while a model step has run for more than half of
  // runtime.timeout (a rank has stopped, most likely; the watchdog ends the server at the full timeout).
  const double stall = deck_.real("runtime.timeout") / 2;
  svr.Get("/health", [this, stall](const Req&, Res& r) {
    const double since = sched_.step_since(), now = wall_seconds();
    std::string why;
    if (!sched_.healthy()) why = "the engine has stopped";
    else if (since > 0 && stall > 0 && now - since > stall)
      why = "a model step has run for " + std::to_string(int(now - since)) + " s (runtime.timeout = " +
            std::to_string(int(2 * stall)) + " s): a rank of the group does not answer";
    if (why.empty()) return r.set_content("{\"status\":\"ok\"}", "application/json");
    r.status = 503;
    r.set_content(dump({{"status", "unhealthy"}, {"reason", why}}), "application/json");
  });
  svr.Get("/metrics", [this](const Req&, Res& r) {
    r.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
}

// Before routing: the API key, the path's UTF-8, a body's length; after: httplib's own answers and a handler's
// exception as OpenAI error objects.
void Server::guards(HttpFront& svr, const std::string& host) {
  using Req = httplib::Request;
  using Res = httplib::Response;
  // A path that is not UTF-8 (GET /%FF) names no route; said so before any handler quotes it. Bodies are checked in
  // handle_completion (read after this).
  // serve.api_key (else Q3VL_API_KEY): every route but /health wants "Authorization: Bearer <key>", as OpenAI's API
  // does; the comparison takes the same time wherever the first difference is.
  std::string key = deck_.str("serve.api_key");
  if (const char* e = std::getenv("Q3VL_API_KEY"); key.empty() && e) key = e;
  if (key.empty() && host != "localhost" && host != "::1" && host.rfind("127.", 0) != 0)
    log_warn("serve: listening on " + host + " without an API key: anyone who can reach this port can use the model "
             "(set serve.api_key or the environment variable Q3VL_API_KEY)");
  // A body with neither length nor chunks is read until the client closes (httplib 0.11): 411 instead, at once.
  svr.set_pre_routing_handler([key](const Req& q, Res& r) {
    std::string m, type = "invalid_request_error";
    if (!key.empty() && q.path != "/health" && !bearer_matches(q.get_header_value("Authorization"), key))
      r.status = 401, m = q.has_header("Authorization") ? "incorrect API key provided" : "an API key is required "
          "(Authorization: Bearer <key>)";
    else if (utf8_error(q.path) != std::string::npos) r.status = 400, m = "the request path is not valid UTF-8";
    else if ((q.method == "POST" || q.method == "PUT" || q.method == "PATCH") && !q.has_header("Content-Length") &&
             q.get_header_value("Transfer-Encoding") != "chunked")
      r.status = 411, m = q.method + " needs Content-Length (or Transfer-Encoding: chunked)";
    else return httplib::Server::HandlerResponse::Unhandled;
    t_close_after = true;
    r.set_header("Connection", "close");
    r.set_content(error_body({r.status, m, type, "", r.status == 401 ? "invalid_api_key" : ""}), "application/json");
    return httplib::Server::HandlerResponse::Handled;
  });
  // Anything httplib answers itself (unknown path, body too large) gets the OpenAI error object too.
  svr.set_error_handler([](const Req& q, Res& r) {
    if (!r.body.empty()) return;
    const std::string m = r.status == 404 ? "no route " + q.method + " " + q.path
                          : r.status == 413 ? "the request body is too large (serve.max_body_mib; a form-encoded body: "
                                              "8 KiB: send Content-Type: application/json)"
                                            : "HTTP " + std::to_string(r.status);
    r.set_content(error_body({r.status, m, r.status == 404 ? "not_found_error" : "invalid_request_error"}),
                  "application/json");
  });
  svr.set_exception_handler([](const Req&, Res& r, std::exception_ptr ep) {
    r.status = 500;
    r.set_content(error_body({500, what_of(ep), "server_error"}), "application/json");
  });
}

int Server::run() {
  engine_.load();
  if (engine_.runner.rank() != 0) {
    engine_.runner.follow();
    return 0;
  }
  configure();
  HttpFront::Limits lim;
  lim.threads = (int)deck_.integer("serve.http_threads");
  lim.header_timeout = deck_.real("serve.header_timeout");
  lim.read_timeout = deck_.real("serve.read_timeout");
  lim.per_client = (int)deck_.integer("serve.max_client_connections");
  lim.max_connections = (int)deck_.integer("serve.max_connections");
  HttpFront svr(lim);
  svr.set_payload_max_length((size_t)max_body_);
  const std::string host = deck_.str("serve.host");
  routes(svr);
  guards(svr, host);
  int port = (int)deck_.integer("serve.port");
  if (port == 0) port = svr.bind_to_any_port(host);
  else if (!svr.bind_to_port(host, port)) port = -1;
  if (port < 0) fail("serve: cannot listen on " + host + ":" + std::to_string(deck_.integer("serve.port")) +
                     " (in use, or not an address of this host)");
  widen_backlog(port);
  created_ = (double)std::time(nullptr);
  std::thread http([&] { svr.listen_after_bind(); });
  log_info("serve: model '" + model_name_ + "' on http://" + host + ":" + std::to_string(port) +
           " (POST /v1/chat/completions, /v1/completions; GET /v1/models, /health, /metrics)");
  try {
    sched_.run();
  } catch (...) {
    // Every open request gets its error, so that the HTTP threads return and the server can end.
    sched_.fail_all(what_of(std::current_exception()));
    svr.stop();
    http.join();
    throw;
  }
  log_info("serve: stopping (signal " + std::to_string(stop_signal_pending()) + ")");
  // Requests still open get what they have so far.
  sched_.finish_open();
  svr.stop();
  http.join();
  engine_.runner.stop();  // the other ranks leave their loop
  return 0;
}

}  // namespace

int run_serve(const Deck& deck) {
  Runtime& rt = Runtime::get();
  stop_init(0, deck.str("run.out_dir"));  // SIGTERM ends serving cleanly on every rank
  Server s(deck);
  const int rc = s.run();
  idle_barrier(rt.world(), "waiting for rank 0 to serve");
  return rc;
}

}  // namespace q3vl
