#include "q3vl/serve/scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/core/parallel.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/runtime/stop.hpp"
#include "q3vl/tensor/profile.hpp"

namespace q3vl {

namespace {

// Length of the longest suffix of text that begins some stop string (held back while streaming).
size_t stop_prefix_tail(const std::string& text, const std::vector<std::string>& stops) {
  size_t keep = 0;
  for (const auto& s : stops)
    for (size_t n = std::min(s.size() - 1, text.size()); n > keep; --n)
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
  return keep;
}

}  // namespace

int64_t StepBudget::prompt_tokens(int64_t decodes) const {
  const int64_t room = std::max<int64_t>(0, cap_ - decodes);
  if (target_ <= 0 || c_ <= 0) return room;
  const double fits = (target_ - d_) / c_;
  return std::min(room, std::max(floor_, int64_t(std::max(0.0, fits + 1e-6))));  // 49.99999 tokens are 50
}

void StepBudget::observe(int64_t decodes, int64_t prompt, double seconds) {
  if (target_ <= 0 || decodes == 0) return;  // a step without decodes says nothing of the time per output token
  auto avg = [](double& a, double x) { a = a > 0 ? (1 - kWeight) * a + kWeight * x : x; };
  if (prompt == 0) return avg(d_, seconds);
  // Until a decode-only step is measured (a busy server runs few), a mixed step's whole time counts against its prompt
  // tokens: the next chunk is then the last one scaled by target / time, which also settles on the target.
  avg(c_, std::max(seconds - d_, 1e-9) / double(prompt));
}

void Scheduler::configure(const EngineConfig& c, const Tokenizer* tok, const SamplingParams& base) {
  tok_ = tok;
  base_ = base;
  max_batch_ = c.max_batch;
  prefix_on_ = c.prefix_cache;
  step_tokens_ = c.step_tokens;
  timeout_ = c.timeout;
  vision_batch_ = c.vision_batch;
  prof_rows_ = c.profile_rows;
  prof_left_[0] = prof_left_[1] = c.profile_steps;
  budget_ = StepBudget(c.max_tpot, c.step_tokens, std::min<int64_t>(c.step_tokens, StepBudget::kFloor));
}

// A prompt's M-RoPE positions, first generated position and prefix-cache keys (the pixels hashed: ~1 ms a picture).
void Scheduler::positions(Job& job) const {
  const ModelConfig& cfg = runner_.config();
  const std::vector<int64_t>& ids = job.prompt.ids;
  job.pos3 = mrope_positions(cfg, ids.data(), {0, (int64_t)ids.size()}, job.prompt.grid);
  for (int64_t p : job.pos3) job.next0 = std::max(job.next0, p + 1);
  if (prefix_on_) job.tkeys = token_keys(job.prompt, job.pos3, cfg);
}

// On the caller's thread (an HTTP handler, generate), so that the engine's thread does not spend a request's
// positions and keys between steps; a prompt they fail on is failed by admit(), which tries again.
void Scheduler::submit(const std::shared_ptr<Job>& job) {
  // generate's stream for prompt `index`: a seeded request answers as generate does for its prompt 0.
  std::seed_seq seq{uint64_t(job->sp.seed), uint64_t(job->sp.seed >> 32), job->index};
  job->rng.seed(seq);
  try {
    positions(*job);
  } catch (const Error&) {
    job->pos3.clear(), job->tkeys.clear(), job->next0 = 0;
  }
  {
    std::lock_guard<std::mutex> g(in_m_);
    incoming_.push_back(job);
    metrics_.queue++;
  }
  in_cv_.notify_one();
}

// Releases the text a client may see: everything decoded so far, less an incomplete UTF-8 character and less a
// tail that may still become a stop string; cut at a stop string found.
// Only the tokens after the text known to be complete decode again, not the whole answer each token: a byte run that
// decodes without U+FFFD ends on a character boundary, so what follows it decodes the same on its own.
void Scheduler::emit(Job& job, bool final) {
  const std::vector<int32_t> ids(job.out.begin() + int64_t(job.fixed_ids), job.out.end());
  const std::string tail = tok_->decode(ids);
  std::string full = job.fixed_text + tail;
  if (tail.find("\xEF\xBF\xBD") == std::string::npos) job.fixed_text = full, job.fixed_ids = job.out.size();
  size_t cut = std::string::npos;
  for (const auto& s : job.stops) cut = std::min(cut, full.find(s));
  bool stop_hit = cut != std::string::npos;
  if (stop_hit) full.resize(cut);
  else if (!final) {
    // Qwen's byte-level tokens split characters: U+FFFD at the end is a character still being decoded.
    while (full.size() >= 3 && full.compare(full.size() - 3, 3, "\xEF\xBF\xBD") == 0) full.resize(full.size() - 3);
    full.resize(full.size() - stop_prefix_tail(full, job.stops));
  }
  std::lock_guard<std::mutex> g(job.m);
  if (full.size() > job.text.size() || stop_hit || final) job.text = full;
  job.completion_tokens = (int64_t)job.out.size();
  if (stop_hit) job.finish = "stop";
}

void Scheduler::finish(Job& job, const std::string& reason) {
  if (job.slot >= 0) {
    if (reason != "error") cache_blocks(job);  // its answer's blocks too: a chat resends them next turn
    const int64_t blocks = (int64_t)blocks_.cache().table[job.slot].size();
    blocks_.release(job.slot);
    job.slot = -1;
    if (reason == "cancelled")
      log_info("serve: a request cancelled (its client left) after " + std::to_string(job.out.size()) +
               " tokens; its " + std::to_string(blocks) + " KV blocks released");
  }
  if (reason == "cancelled") metrics_.cancelled++;
  {
    std::lock_guard<std::mutex> g(job.m);
    if (job.finish.empty()) job.finish = reason;
    job.done = true;
  }
  job.cv.notify_all();
  metrics_.completion_tokens += (int64_t)job.out.size();
  if (job.out.size() > 1) {
    std::lock_guard<std::mutex> g(metrics_.m);
    metrics_.tpot_sum += wall_seconds() - job.t_first;
    metrics_.tpot_n += (int64_t)job.out.size() - 1;
  }
}

void Scheduler::update_kv_metrics() {
  metrics_.kv_used = blocks_.used();
  metrics_.prefix_blocks = blocks_.cached();
  metrics_.evicted = blocks_.evicted();
}

// FIFO admission: the head of the queue waits until the cache has blocks for its prompt and max_tokens, so that a
// running sequence never runs out of cache (no preemption needed) and a full cache queues instead of failing.
// Cached prefix blocks no sequence uses count as free: they are evicted (least recently used first) before anyone
// waits for them.
void Scheduler::admit() {
  const ModelConfig& cfg = runner_.config();
  const int64_t B = blocks_.cache().block;
  std::vector<Job*> fresh;  // admitted now, with images or videos to encode
  while (!waiting_.empty() && (int64_t)running_.size() < max_batch_) {
    std::shared_ptr<Job> job = waiting_.front();
    const std::vector<int64_t>& ids = job->prompt.ids;
    const int64_t n = (int64_t)ids.size();
    try {
      if (job->pos3.empty()) positions(*job);  // submit's failed (or a prompt without tokens)
    } catch (const Error& e) {
      waiting_.pop_front(), metrics_.queue--;
      job->error = e.what();
      finish(*job, "error");
      continue;
    }
    const BlockManager::Match hit = blocks_.match(job->tkeys);
    const int64_t tokens = n + job->sp.max_new_tokens;
    if (!blocks_.fits(tokens, hit)) {
      if (!running_.empty()) break;  // it waits for blocks to come back
      waiting_.pop_front(), metrics_.queue--;  // the whole cache is not enough
      job->error = "the prompt and max_tokens need " + std::to_string(blocks_.cache().blocks_for(tokens)) +
                   " KV-cache blocks; the whole cache has " + std::to_string(blocks_.cache().max_blocks);
      finish(*job, "error");
      continue;
    }
    waiting_.pop_front();
    metrics_.queue--;
    const int64_t shared = (int64_t)hit.blocks.size() * B;
    const auto visual = [&](int64_t t) { return cfg.visual_token(t); };  // image and video placeholders
    job->slot = blocks_.open(tokens, hit, job->next0);
    job->fed = shared;
    job->vis_fed = std::count_if(ids.begin(), ids.begin() + shared, visual);
    job->chain = hit.chain;
    metrics_.prefix_hit_tokens += shared;
    running_.push_back(job);
    // The vision tower only when some image or video token is still to compute.
    if (!job->prompt.grid.empty() && std::count_if(ids.begin() + shared, ids.end(), visual) > 0) fresh.push_back(job.get());
    else std::vector<float>().swap(job->prompt.pixels);
  }
  encode(fresh);
  std::erase_if(running_, [](const std::shared_ptr<Job>& j) { return j->done; });  // a bad image or video
}

// The vision tower for the jobs just admitted, in as few passes as its patch budget allows (serve.vision_batch; else
// a pass each), jobs in order. A pass that fails is redone a job at a time, so that only a job with bad input fails.
void Scheduler::encode(const std::vector<Job*>& jobs) {
  DevModel& m = runner_.model();
  const int64_t budget = m.vision_budget(), pd = runner_.config().vision.patch_dim();
  for (size_t a = 0, b = 0; a < jobs.size(); a = b) {
    int64_t patches = 0;
    for (b = a; b < jobs.size(); ++b) {
      const int64_t p = (int64_t)jobs[b]->prompt.pixels.size() / pd;
      if (b > a && (!vision_batch_ || patches + p > budget)) break;
      patches += p;
    }
    encode_pass(jobs, a, b);
  }
}

void Scheduler::encode_pass(const std::vector<Job*>& jobs, size_t a, size_t b) {
  std::vector<DevModel::VisionJob> v;
  for (size_t k = a; k < b; ++k) v.push_back({&jobs[k]->prompt.pixels, &jobs[k]->prompt.grid, &jobs[k]->img, &jobs[k]->ds});
  const double t0 = wall_seconds();
  try {
    runner_.model().vision_features(v);
  } catch (const Error& e) {
    if (b - a > 1) {
      for (size_t k = a; k < b; ++k) encode_pass(jobs, k, k + 1);
      return;
    }
    jobs[a]->error = e.what();
    finish(*jobs[a], "error");
    return;
  }
  metrics_.vision_s += wall_seconds() - t0, metrics_.vision_encodes += int64_t(b - a), metrics_.vision_passes++;
  for (size_t k = a; k < b; ++k) std::vector<float>().swap(jobs[k]->prompt.pixels);  // in img and ds now (and the keys)
}

bool Scheduler::tick(bool wait) {
  {
    std::unique_lock<std::mutex> l(in_m_);
    if (wait && incoming_.empty() && running_.empty() && waiting_.empty())
      in_cv_.wait_for(l, std::chrono::milliseconds(200));
    while (!incoming_.empty()) waiting_.push_back(incoming_.front()), incoming_.pop_front();
  }
  const double t0 = wall_seconds();
  drop_gone();
  admit();
  metrics_.running = (int64_t)running_.size();
  update_kv_metrics();
  if (running_.empty()) return !waiting_.empty();
  step();
  metrics_.busy_s += wall_seconds() - t0;
  return true;
}

void Scheduler::run() {
  while (!stop_signal_pending()) tick(true);
}

void Scheduler::drain() {
  while (tick(false)) {
  }
}

// Clients gone while queued or running: their sequences and blocks go back at once.
void Scheduler::drop_gone() {
  for (auto it = waiting_.begin(); it != waiting_.end();)
    if ((*it)->cancelled) finish(**it, "cancelled"), it = waiting_.erase(it), metrics_.queue--;
    else ++it;
  std::erase_if(running_, [&](const std::shared_ptr<Job>& j) {
    if (j->cancelled) finish(*j, "cancelled");
    return (bool)j->cancelled;
  });
  // serve.timeout: a request still queued gets 503; a running one ends with what it has ("length").
  if (timeout_ > 0) {
    const double now = wall_seconds();
    for (auto it = waiting_.begin(); it != waiting_.end();)
      if (now - (*it)->t_arrival > timeout_) {
        (*it)->error = "the request waited " + std::to_string(int(now - (*it)->t_arrival)) +
                       " s in the queue, past serve.timeout; the server is busy, try again later";
        (*it)->status = 503;
        finish(**it, "error"), it = waiting_.erase(it), metrics_.queue--, metrics_.timed_out++;
      } else {
        ++it;
      }
    std::erase_if(running_, [&](const std::shared_ptr<Job>& j) {
      if (now - j->t_arrival <= timeout_) return false;
      finish(*j, "length"), metrics_.timed_out++;
      return true;
    });
  }
}

// One step: a token of every decoding sequence, then prompt chunks up to serve.step_tokens in all (fewer under
// serve.max_tpot_ms: budget_).
std::pair<int64_t, int64_t> Scheduler::plan(std::vector<StepSegment<float>>& segs, std::vector<Job*>& who) {
  const ModelConfig& cfg = runner_.config();
  const int64_t H = cfg.text.hidden;
  for (auto& j : running_)
    if (j->pending >= 0) {
      segs.push_back({j->slot, {j->pending}, {}, {}, {}});
      who.push_back(j.get());
    }
  const int64_t decodes = int64_t(segs.size()), room = budget_.prompt_tokens(decodes);
  metrics_.step_prompt_budget = room;
  int64_t budget = room;
  for (auto& j : running_) {
    const int64_t n = (int64_t)j->prompt.ids.size();
    if (j->fed >= n || budget <= 0) continue;
    const int64_t a = j->fed, b = std::min(n, a + budget);
    StepSegment<float> g;
    g.seq = j->slot;
    g.ids.assign(j->prompt.ids.begin() + a, j->prompt.ids.begin() + b);
    for (int row = 0; row < 3; ++row)
      g.pos3.insert(g.pos3.end(), j->pos3.begin() + row * n + a, j->pos3.begin() + row * n + b);
    const int64_t nv = std::count_if(g.ids.begin(), g.ids.end(), [&](int64_t t) { return cfg.visual_token(t); });
    if (nv > 0 && j->vis_fed == 0 && nv * H == (int64_t)j->img.size()) {  // all of them (usual): moved, not copied
      g.img = std::move(j->img), g.ds = std::move(j->ds);
    } else if (nv > 0) {
      g.img.assign(j->img.begin() + j->vis_fed * H, j->img.begin() + (j->vis_fed + nv) * H);
      for (const auto& d : j->ds) g.ds.emplace_back(d.begin() + j->vis_fed * H, d.begin() + (j->vis_fed + nv) * H);
    }
    j->vis_fed += nv;
    budget -= b - a;
    metrics_.prefill_tokens += b - a;
    segs.push_back(std::move(g));
    who.push_back(j.get());
  }
  return {decodes, room - budget};
}

// Once: serve.max_tpot_ms below what the decodes alone take, which no chunk size can meet (prompts then get the
// floor, and the batch fills more slowly: fewer tokens a second).
void Scheduler::warn_tpot(int64_t decodes) {
  const double d = budget_.decode_seconds(), target = budget_.target();
  if (tpot_warned_ || target <= 0 || d <= target) return;
  tpot_warned_ = true;
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "serve.max_tpot_ms = %g is below a decode-only step of %lld sequences here (%.1f ms): steps carry the "
                "floor of %lld prompt tokens; raise the target or lower serve.max_batch",
                target * 1000, (long long)decodes, d * 1000, (long long)StepBudget::kFloor);
  log_warn(buf);
}

void Scheduler::step() {
  const ModelConfig& cfg = runner_.config();
  const int64_t V = cfg.text.vocab;
  std::vector<StepSegment<float>> segs;
  std::vector<Job*> who;
  const double t_plan = wall_seconds();
  const auto [decodes, prompt] = plan(segs, who);
  // serve.profile_steps: this step op by op under the step profiler, its host phases timed (profile_end).
  int64_t& prof_left = prof_left_[prompt > 0];
  const bool profiling = prof_left > 0 && (int64_t)segs.size() >= prof_rows_;
  DevModel::StepPhases phases;
  if (profiling) prof_left--, runner_.model().set_step_phases(&phases), prof::begin_step(runner_.model().exec(), true);
  // All greedy (the usual serving case): the device returns each row's argmax, not [segs, V] of logits.
  DevModel::Argmax best;
  const bool greedy =
      (int64_t)base_.banned.size() <= DevModel::kMaxBanned && std::all_of(who.begin(), who.end(), [&](const Job* j) {
        return j->sp.temperature <= 0 && j->sp.banned == base_.banned && j->sp.vocab_limit == base_.vocab_limit;
      });
  best.limit = base_.vocab_limit > 0 ? base_.vocab_limit : cfg.text.vocab, best.banned = base_.banned;
  std::vector<float> logits;
  double t_step = 0;
  try {
    t_step = wall_seconds();
    const double t0 = t_step;
    step_since_ = t0;
    logits = runner_.step(segs, false, greedy ? &best : nullptr);
    step_since_ = 0;
    const double took = wall_seconds() - t0;
    if (!profiling) budget_.observe(decodes, prompt, took);  // op by op it takes longer than it will
    warn_tpot(decodes);
    const int64_t rows = int64_t(segs.size());
    if (prompt > 0) metrics_.mixed_s += took, metrics_.mixed_steps++, metrics_.mixed_rows += rows;
    else metrics_.decode_s += took, metrics_.decode_steps++, metrics_.decode_rows += rows;
  } catch (const Error& e) {  // fails this step's requests, not the server
    step_since_ = 0;
    if (profiling) runner_.model().set_step_phases(nullptr), prof::end_step(0, 0, {});
    if (is_watchdog(e)) {  // a rank did not keep up: the group is out of step, and the server ends
      healthy_ = false;
      throw;
    }
    log_warn(std::string("serve: a step failed: ") + e.what());
    for (Job* j : who) j->error = e.what(), finish(*j, "error");
    std::erase_if(running_, [](const std::shared_ptr<Job>& j) { return j->done; });
    return;
  }
  metrics_.steps++;
  const double now = wall_seconds();
  std::vector<size_t> rows;  // the segments that sample: a decode, or a prompt's last chunk
  for (size_t s = 0; s < segs.size(); ++s) {
    Job& j = *who[s];
    if (j.pending < 0) {  // a prompt chunk: sample only after its last one
      j.fed += (int64_t)segs[s].ids.size();
      if (j.fed < (int64_t)j.prompt.ids.size()) continue;
      j.img.clear(), j.ds.clear();
      cache_blocks(j);  // later requests may share the prompt while this one decodes
    }
    rows.push_back(s);
  }
  // Sampled rows on every core (each job draws from its own random stream, so their order does not matter);
  // greedy ones are already picked.
  std::vector<int64_t> tok(segs.size());
  if (greedy)
    for (size_t s : rows) tok[s] = std::max<int64_t>(best.id[s], 0);
  else
    parallel_for((int64_t)rows.size(), [&](int64_t i) {
      const size_t s = rows[i];
      tok[s] = sample_token(&logits[s * V], V, who[s]->sp, who[s]->rng);
    });
  for (size_t s : rows) advance(*who[s], tok[s], now);
  std::erase_if(running_, [](const std::shared_ptr<Job>& j) { return j->done; });
  metrics_.running = (int64_t)running_.size();
  update_kv_metrics();
  if (profiling) profile_end(t_plan, t_step, now, phases, decodes, prompt, (int64_t)segs.size());
}

// A profiled step's report to the log: its per-op table and host phases (the step from plan() to the tokens
// streamed), lines "serve profile: ...", then the same as one line of JSON ("serve profile json: {...}").
void Scheduler::profile_end(double t_plan, double t_step, double t_ran, const DevModel::StepPhases& ph,
                            int64_t decodes, int64_t prompt, int64_t rows) {
  runner_.model().set_step_phases(nullptr);
  const double t_end = wall_seconds();
  const double runner_rest = (t_ran - t_step) - (ph.pack + ph.upload + ph.device + ph.download);
  prof::Report r = prof::end_step(metrics_.steps, t_end - t_plan,
                                  {{"plan (scheduler: segments, chunk copies)", t_step - t_plan},
                                   {"pack_step and metadata (host)", ph.pack},
                                   {"uploads", ph.upload},
                                   {"device work (op by op, waited for)", ph.device},
                                   {"downloads (logits or argmax)", ph.download},
                                   {"runner (plan to ranks, gathers)", runner_rest},
                                   {"sampling, detokenizing, streaming", t_end - t_ran}},
                                  40);
  const char* kind = prompt > 0 ? "mixed" : "decode-only";
  char buf[200];
  std::snprintf(buf, sizeof buf, "serve profile: a %s step of %lld rows (%lld decodes, %lld prompt tokens), op by op:",
                kind, (long long)rows, (long long)decodes, (long long)prompt);
  log_info(buf);
  for (const std::string& line : r.table()) log_info("serve profile: " + line);
  nlohmann::json j = r.json();
  j["kind"] = kind, j["rows"] = rows, j["decodes"] = decodes, j["prompt_tokens"] = prompt;
  log_info("serve profile json: " + j.dump());
}

// A job's new token t: the end on a stop token, max_tokens or a stop string; else its text so far to the client.
void Scheduler::advance(Job& j, int64_t t, double now) {
  if (!j.first_token) {
    j.first_token = true;
    j.t_first = now;
    std::lock_guard<std::mutex> g(metrics_.m);
    metrics_.ttft_sum += now - j.t_arrival, metrics_.ttft_n++;
  }
  std::string reason;
  if (std::find(j.sp.stop.begin(), j.sp.stop.end(), t) != j.sp.stop.end()) {
    reason = "stop";
  } else {
    j.out.push_back(t);
    j.pending = t;
    if ((int64_t)j.out.size() >= j.sp.max_new_tokens) reason = "length";
  }
  if (!j.offline) emit(j, !reason.empty());
  bool stop_string;
  {
    std::lock_guard<std::mutex> g(j.m);
    stop_string = !j.finish.empty();
  }
  if (!reason.empty() || stop_string) finish(j, reason);
  else j.cv.notify_all();
}

void Scheduler::fail_all(const std::string& why) {
  healthy_ = false;
  std::vector<std::shared_ptr<Job>> open(running_.begin(), running_.end());
  open.insert(open.end(), waiting_.begin(), waiting_.end());
  {
    std::lock_guard<std::mutex> g(in_m_);
    open.insert(open.end(), incoming_.begin(), incoming_.end());
    incoming_.clear();
  }
  for (auto& j : open) {
    j->error = "the server stopped: " + why, j->status = 503;
    j->slot = -1;  // its cache slot goes with the server
    finish(*j, "error");
  }
}

void Scheduler::finish_open() {
  for (auto& j : running_) finish(*j, "length");
  for (auto& j : waiting_) finish(*j, "length");
}

}  // namespace q3vl
