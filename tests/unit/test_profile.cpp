// run.profile's profiler (tensor/profile.hpp) on a profiled forward + backward of a tiny model: the ops that ran, with
// the call counts the layer count implies, phases that add up to the step, no NaN anywhere. Never a timing.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <chrono>

#include "../gpu.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/train/eval.hpp"
#include "q3vl/tensor/profile.hpp"
#include "tiny_model.hpp"

using namespace q3vl;

namespace {

struct Profiled {
  std::map<std::string, int64_t> calls;  // by row name
  prof::Report rep;
};

// One profiled forward + backward of the tiny dense model with `layers` decoder layers (all rows kept).
Profiled profiled_pass(Device d, int layers, bool shapes = false) {
  ModelConfig cfg = test::tiny(false, true);
  cfg.text.layers = layers;
  Model host(cfg);
  host.init_random(7);
  std::mt19937 rng(3);
  const Batch batch = test::tiny_batch(rng);
  dev::Exec ex = dev::make_exec(d);
  Profiled p;
  {
    DevModel m(cfg, ex, DType::F32);
    m.reserve(budget_for(batch, cfg.vision.patch_dim()));
    m.set_params(host.params());
    prof::begin_step(ex, shapes);
    const double t0 = wall_seconds();
    m.forward(batch, true, nullptr, nullptr, false);
    const double t1 = wall_seconds();
    m.backward();
    dev::synchronize(ex);
    const double t2 = wall_seconds();
    p.rep = prof::end_step(1, t2 - t0, {{"forward", t1 - t0}, {"backward", t2 - t1}}, 1000);
  }
  dev::destroy_exec(ex);
  for (const prof::Row& r : p.rep.rows) p.calls[r.name] = r.calls;
  return p;
}

void check_counts(Device d) {
  const Profiled p1 = profiled_pass(d, 1), p2 = profiled_pass(d, 2), p3 = profiled_pass(d, 3);
  // A dense decoder layer's backward: the fused q|k|v, o, the fused gate|up and down, one linear_bwd each.
  EXPECT_EQ(p2.calls.at("linear_bwd") - p1.calls.at("linear_bwd"), 4);
  EXPECT_EQ(p3.calls.at("linear_bwd") - p2.calls.at("linear_bwd"), 4);
  // It zeroes no buffer: the first op to produce each gradient writes it (dev.hpp).
  EXPECT_EQ(p2.calls.at("fill"), p1.calls.at("fill"));
  EXPECT_EQ(p3.calls.at("fill"), p2.calls.at("fill"));
  // Its forward: the same four linears (once each; no recomputation).
  EXPECT_EQ(p2.calls.at("linear_fwd") - p1.calls.at("linear_fwd"), 4);
  EXPECT_EQ(p3.calls.at("linear_fwd") - p2.calls.at("linear_fwd"), 4);
  // One attention forward and backward a decoder layer, on top of the vision tower's (2 blocks).
  EXPECT_EQ(p3.calls.at("attention_fwd"), 3 + 2);
  EXPECT_EQ(p3.calls.at("attention_bwd"), 3 + 2);
  EXPECT_EQ(p3.calls.at("cross_entropy"), p1.calls.at("cross_entropy"));
  for (const char* op : {"rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd", "embedding_fwd", "layernorm_fwd"})
    EXPECT_GT(p3.calls.count(op), 0u) << op << " ran but has no row";
  const prof::Report& r = p3.rep;
  EXPECT_EQ(r.device, d == Device::CUDA ? "cuda" : "cpu");
  double pct = 0, ms = 0;
  ASSERT_EQ(r.phases.size(), 3u);
  EXPECT_EQ(r.phases.back().name, "host / unaccounted");
  for (const prof::PhaseTime& ph : r.phases) {
    EXPECT_TRUE(std::isfinite(ph.ms) && std::isfinite(ph.pct)) << ph.name;
    pct += ph.pct, ms += ph.ms;
  }
  EXPECT_NEAR(pct, 100, 0.01);
  EXPECT_NEAR(ms, r.step_ms, 1e-6 * r.step_ms + 1e-9);
  int64_t regions = 0;
  for (const prof::Row& row : r.rows) {
    for (double v : {row.ms, row.pct, row.tflops, row.gbps, row.idle})
      EXPECT_TRUE(std::isfinite(v) && v >= 0) << row.name;
    EXPECT_GT(row.calls, 0) << row.name;
    regions += row.calls;
  }
  EXPECT_EQ(regions, r.regions);
  EXPECT_TRUE(std::isfinite(r.busy_ms) && std::isfinite(r.exposed_comm_ms));
  // The JSON object: the same rows, numbers only (a NaN would be written as null).
  const nlohmann::json j = r.json();
  EXPECT_EQ(j.at("ops").size(), r.rows.size());
  EXPECT_EQ(j.dump().find("null"), std::string::npos) << j.dump();
  EXPECT_EQ(r.table().size(), 5 + r.phases.size() + r.rows.size());  // title, 2 headers, total, summary
}

}  // namespace

TEST(Profile, CallCountsFollowTheLayersOnCpu) { check_counts(Device::CPU); }

TEST(Profile, CallCountsFollowTheLayersOnCuda) {
  Q3VL_NEED_GPU();
  check_counts(Device::CUDA);
}

// With shapes (run.profile_shapes), the linears' and attention's rows split by shape and add up to the rows by op.
TEST(Profile, ShapesSplitTheRowsAndKeepTheCounts) {
  const Profiled by_op = profiled_pass(Device::CPU, 2), by_shape = profiled_pass(Device::CPU, 2, true);
  for (const char* op : {"linear_fwd", "linear_bwd", "attention_fwd", "attention_bwd"}) {
    int64_t sum = 0, rows = 0;
    for (const auto& [name, n] : by_shape.calls)
      if (name.rfind(std::string(op) + " ", 0) == 0) sum += n, ++rows;
    EXPECT_EQ(by_shape.calls.count(op), 0u) << op << " has a row without its shape";
    EXPECT_EQ(sum, by_op.calls.at(op)) << op;
    EXPECT_GE(rows, 2) << op << ": the text and vision shapes differ";
  }
  bool causal = false;
  for (const auto& [name, n] : by_shape.calls) causal |= name.rfind("attention_fwd ", 0) == 0 &&
                                                            name.find(" causal") != std::string::npos;
  EXPECT_TRUE(causal) << "the decoder's attention is causal and says so";
}

// Off (outside begin_step .. end_step) nothing is recorded; the top rows end with "other".
TEST(Profile, RecordsOnlyInsideAStepAndFoldsTheRest) {
  dev::Exec cpu{};
  std::vector<float> a(64, 1.f), b(64, 2.f);
  dev::axpy(cpu, 1.f, a.data(), b.data(), 64, DType::F32);
  prof::begin_step(cpu);
  prof::Report r = prof::end_step(1, 0.001, {});
  EXPECT_EQ(r.regions, 0);
  EXPECT_TRUE(r.rows.empty());
  prof::begin_step(cpu);
  dev::axpy(cpu, 1.f, a.data(), b.data(), 64, DType::F32);
  dev::scale(cpu, b.data(), 64, 0.5f, DType::F32);
  dev::fill(cpu, b.data(), DType::F32, 64, 0.f);
  r = prof::end_step(2, 0.001, {{"all", 0.001}}, 2);
  EXPECT_EQ(r.regions, 3);
  ASSERT_EQ(r.rows.size(), 3u);
  EXPECT_EQ(r.rows.back().name, "other (1 row)");
  EXPECT_EQ(r.rows.back().calls, 1);
  EXPECT_GT(r.rows[0].gbps + r.rows[1].gbps, 0) << "memory-bound ops have a byte count";
}

// A row's idle time is the op layer's wait for the host just before its calls: the first op has none, an op issued
// after the host slept at least the sleep; every row's idle is finite and within the step.
TEST(Profile, IdleIsTheWaitBeforeARow) {
  dev::Exec cpu{};
  std::vector<float> a(64, 1.f), b(64, 2.f);
  prof::begin_step(cpu);
  const double t0 = wall_seconds();
  dev::axpy(cpu, 1.f, a.data(), b.data(), 64, DType::F32);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  dev::scale(cpu, b.data(), 64, 0.5f, DType::F32);
  const prof::Report r = prof::end_step(1, wall_seconds() - t0, {});
  std::map<std::string, double> idle;
  for (const prof::Row& row : r.rows) idle[row.name] = row.idle;
  EXPECT_EQ(idle.at("axpy"), 0.0);
  EXPECT_GE(idle.at("scale"), 20.0);
  EXPECT_LE(idle.at("scale"), r.step_ms);
  EXPECT_DOUBLE_EQ(r.json().at("ops")[0].at("idle_ms").get<double>(), r.rows[0].idle);
}
