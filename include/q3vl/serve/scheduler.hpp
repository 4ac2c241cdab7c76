// The serving engine's scheduler (as nano-vllm's): the queue of jobs (the HTTP threads' requests, or generate's
// prompts), FIFO admission into the running batch over the block manager's paged KV cache, and the step loop on
// rank 0. Every step mixes chunks of new prompts with one token of each running sequence; the runner computes it on
// every rank, and the scheduler samples, releases each request's text (emit) and ends jobs (finish), which wakes
// their HTTP threads.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/serve/block_manager.hpp"
#include "q3vl/serve/generate.hpp"
#include "q3vl/serve/runner.hpp"

namespace q3vl {

// One request from HTTP thread (or generate) to engine and back. The engine owns the fields below `engine only`; the
// rest are guarded by m.
struct Job {
  // Set before the engine sees it.
  bool chat = true, stream = false, include_usage = false;
  bool offline = false;  // generate's: no text released as it runs (the tokens are the answer)
  GenPrompt prompt;
  SamplingParams sp;
  uint64_t index = 0;  // the sampling stream's: seeded by (sp.seed, index), generate's prompt number (serve: 0)
  std::vector<std::string> stops;
  double t_arrival = 0;

  std::mutex m;
  std::condition_variable cv;
  std::string text;       // released to the client: complete UTF-8, stop strings cut off
  bool done = false;
  std::string finish;     // "stop" or "length"
  std::string error;      // the engine failed this request (status: 500; 503 timed out in the queue)
  int status = 500;
  int64_t completion_tokens = 0;
  std::atomic<bool> cancelled{false};  // the client went away

  // Engine only.
  int slot = -1;
  int64_t fed = 0;        // prompt tokens in the cache
  int64_t pending = -1;   // sampled token still to be fed
  int64_t vis_fed = 0;    // image and video tokens fed so far
  int64_t next0 = 0;      // position of the first generated token
  std::vector<int64_t> out, pos3;
  std::string fixed_text;  // the text of out's first fixed_ids tokens, complete characters (emit)
  size_t fixed_ids = 0;
  std::vector<uint64_t> tkeys;  // prompt tokens' prefix-cache content (token_keys)
  std::vector<uint64_t> chain;  // prefix-cache keys of the sequence's full blocks so far
  std::vector<float> img;
  std::vector<std::vector<float>> ds;
  std::mt19937_64 rng;
  bool first_token = false;
  double t_first = 0;
};

// Counters for /metrics (Prometheus text).
struct Metrics {
  std::atomic<int64_t> requests{0}, errors{0}, prompt_tokens{0}, completion_tokens{0};
  std::atomic<int64_t> queue{0}, running{0}, kv_used{0}, kv_total{0}, steps{0};
  std::atomic<int64_t> prefill_tokens{0}, prefix_hit_tokens{0}, prefix_blocks{0}, evicted{0}, cancelled{0},
      timed_out{0};
  std::atomic<int64_t> step_prompt_budget{0};  // prompt tokens the last step could carry (serve.max_tpot_ms)
  // Where the engine's time goes (/metrics q3vl_engine_*): steps with decodes only and steps carrying prompt chunks
  // (wall seconds of runner.step, their rows), the vision tower at admission, and every tick that had work (so
  // busy - steps - vision is the host's own scheduling, sampling and streaming).
  // vision_encodes: prompts encoded; vision_passes: passes of the tower (a pass takes several: serve.vision_batch).
  std::atomic<int64_t> decode_steps{0}, decode_rows{0}, mixed_steps{0}, mixed_rows{0}, vision_encodes{0},
      vision_passes{0};
  std::atomic<double> decode_s{0}, mixed_s{0}, vision_s{0}, busy_s{0};
  std::mutex m;
  double ttft_sum = 0, tpot_sum = 0;
  int64_t ttft_n = 0, tpot_n = 0;
};

// serve.max_tpot_ms: how many prompt tokens a step may carry beside its decodes so that it ends within the target
// (a step brings every decoding sequence one token, so its time is their time per output token). The step's time is
// modelled from the steps so far as d + c x chunk tokens: d, a decode-only step's time (moving average), and c, the
// seconds a prompt token adds (moving average of what mixed steps took beyond d; all of it until d is measured).
// Until c is measured, and with no target, a step carries serve.step_tokens. A step always admits at least `floor` prompt tokens, so prompts keep
// moving when the decodes alone take the target.
class StepBudget {
 public:
  static constexpr int64_t kFloor = 32;  // prompt tokens a step carries at least (no more than serve.step_tokens)
  StepBudget() = default;
  StepBudget(double target, int64_t cap, int64_t floor) : target_(target), cap_(cap), floor_(floor) {}
  int64_t prompt_tokens(int64_t decodes) const;  // the prompt tokens the next step may carry
  void observe(int64_t decodes, int64_t prompt, double seconds);
  double target() const { return target_; }
  double decode_seconds() const { return d_; }       // 0: not measured yet
  double token_seconds() const { return c_; }

 private:
  static constexpr double kWeight = 0.2;  // of the newest step in the moving averages
  double target_ = 0;
  int64_t cap_ = 1, floor_ = 1;
  double d_ = 0, c_ = 0;
};

class Scheduler {
 public:
  Scheduler(Runner& runner, BlockManager& blocks, Metrics& metrics)
      : runner_(runner), blocks_(blocks), metrics_(metrics) {}
  // tok decodes answers (null: offline jobs only), base is the model's sampling (a greedy batch's banned tokens and
  // vocabulary limit). Before run().
  void configure(const EngineConfig& c, const Tokenizer* tok, const SamplingParams& base);
  // From an HTTP thread (or generate): the job joins the queue.
  void submit(const std::shared_ptr<Job>& job);
  // From an HTTP thread: a job's client went away (job->cancelled set); the engine looks now.
  void wake() { in_cv_.notify_one(); }
  // The step loop on rank 0, until a stop signal. A watchdog's error (a rank stopped) ends it, unhealthy.
  void run();
  // Offline (generate): the step loop until every job submitted is done.
  void drain();
  // The loop failed (why): every open request gets a 503 naming it, and the engine is unhealthy.
  void fail_all(const std::string& why);
  // Stopping: requests still open get what they have so far.
  void finish_open();
  bool healthy() const { return healthy_; }
  double step_since() const { return step_since_; }  // when the model step under way began (0: none)

 private:
  // Takes in new jobs, admits, steps: false when there was nothing to do (wait: for a job first, a little while).
  bool tick(bool wait);
  void drop_gone();
  void positions(Job& job) const;  // pos3, next0 and tkeys of its prompt
  void admit();
  void encode(const std::vector<Job*>& jobs);
  void encode_pass(const std::vector<Job*>& jobs, size_t a, size_t b);  // jobs [a, b) in one pass
  // One step: the segments (plan), the model step on every rank, then each sampling row's token.
  // Returns the step's decodes and prompt tokens (what serve.max_tpot_ms's model learns from).
  std::pair<int64_t, int64_t> plan(std::vector<StepSegment<float>>& segs, std::vector<Job*>& who);
  void step();
  void profile_end(double t_plan, double t_step, double t_ran, const DevModel::StepPhases& ph, int64_t decodes,
                   int64_t prompt, int64_t rows);
  void advance(Job& job, int64_t token, double now);
  void finish(Job& job, const std::string& reason);
  void cache_blocks(Job& j) { blocks_.cache_blocks(j.slot, j.tkeys, j.out, j.next0, j.chain); }
  void update_kv_metrics();
  void warn_tpot(int64_t decodes);
  void emit(Job& job, bool final);

  Runner& runner_;
  // The KV cache's bookkeeping and its prefix cache: rank 0 decides, the other ranks replay its log before each step.
  BlockManager& blocks_;
  Metrics& metrics_;
  const Tokenizer* tok_ = nullptr;
  SamplingParams base_;
  int64_t max_batch_ = 0, step_tokens_ = 0;
  StepBudget budget_;
  bool tpot_warned_ = false;
  double timeout_ = 0;  // serve.timeout
  bool prefix_on_ = true;
  bool vision_batch_ = true;  // serve.vision_batch
  // serve.profile_steps: decode-only [0] and mixed [1] steps of at least prof_rows_ rows still to profile.
  int64_t prof_left_[2] = {0, 0}, prof_rows_ = 0;

  std::mutex in_m_;
  std::condition_variable in_cv_;
  std::deque<std::shared_ptr<Job>> incoming_;
  std::deque<std::shared_ptr<Job>> waiting_;   // engine only
  std::vector<std::shared_ptr<Job>> running_;  // engine only
  std::atomic<bool> healthy_{true};    // false once the engine has stopped
  std::atomic<double> step_since_{0};  // when the model step under way began (0: none)
};

}  // namespace q3vl
