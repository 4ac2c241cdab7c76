// serve.max_tpot_ms (StepBudget): the prompt tokens a step carries beside its decodes, from a model of the step's
// time measured as the server runs.
#include <gtest/gtest.h>

#include "q3vl/serve/scheduler.hpp"

namespace q3vl {

// A device whose step takes 10 ms for its decodes and 0.1 ms a prompt token: with a 15 ms target the budget settles
// at the 50 tokens that fit, and the steps then keep the target (within the moving averages' rounding).
TEST(StepBudget, SettlesWhereTheStepKeepsTheTarget) {
  auto device = [](int64_t prompt) { return 0.010 + 1e-4 * double(prompt); };
  StepBudget b(0.015, 2048, StepBudget::kFloor);
  EXPECT_EQ(b.prompt_tokens(20), 2048 - 20);  // nothing measured: serve.step_tokens
  b.observe(20, 0, device(0));                 // a decode-only step
  EXPECT_EQ(b.prompt_tokens(20), 2048 - 20);  // the prompt token's cost not measured yet
  double worst = 0;
  for (int i = 0; i < 40; ++i) {
    const int64_t n = b.prompt_tokens(20);
    const double t = device(n);
    b.observe(20, n, t);
    if (i >= 2) worst = std::max(worst, t);
  }
  EXPECT_NEAR(b.decode_seconds(), 0.010, 1e-12);
  EXPECT_NEAR(b.token_seconds(), 1e-4, 1e-9);
  EXPECT_EQ(b.prompt_tokens(20), 50);
  EXPECT_LE(worst, 0.015 * 1.001);
}

// The device gets slower (a longer context): the budget follows it down; decodes alone past the target still leave
// prompts the floor; no target, or steps without decodes, change nothing.
TEST(StepBudget, FollowsTheDeviceAndKeepsPromptsMoving) {
  StepBudget b(0.015, 512, StepBudget::kFloor);
  b.observe(8, 0, 0.010);
  b.observe(8, 100, 0.020);  // 0.1 ms a token
  EXPECT_EQ(b.prompt_tokens(8), 50);
  for (int i = 0; i < 60; ++i) b.observe(8, 0, 0.014);  // decodes alone near the target
  EXPECT_EQ(b.prompt_tokens(8), StepBudget::kFloor);   // 10 tokens would fit; the floor is 32
  for (int i = 0; i < 60; ++i) b.observe(8, 0, 0.030);  // past it
  EXPECT_EQ(b.prompt_tokens(8), StepBudget::kFloor);
  EXPECT_EQ(b.prompt_tokens(500), 12);  // never more than serve.step_tokens in all

  // A busy server that never runs a decode-only step: each chunk is the last one scaled by target / time, which
  // settles on the target as well.
  auto device = [](int64_t prompt) { return 0.010 + 1e-4 * double(prompt); };
  StepBudget busy(0.015, 512, StepBudget::kFloor);
  busy.observe(8, 200, device(200));
  EXPECT_LT(busy.prompt_tokens(8), 200);
  double t = 0;
  for (int i = 0; i < 60; ++i) {
    const int64_t n = busy.prompt_tokens(8);
    busy.observe(8, n, t = device(n));
  }
  EXPECT_NEAR(t, 0.015, 0.0003);
  EXPECT_EQ(busy.decode_seconds(), 0);

  StepBudget off(0, 512, StepBudget::kFloor);
  off.observe(8, 0, 0.010), off.observe(8, 100, 0.5);
  EXPECT_EQ(off.prompt_tokens(8), 504);
  StepBudget prefill_only(0.015, 512, StepBudget::kFloor);
  prefill_only.observe(0, 400, 0.5);  // no decodes: no time per output token to keep
  EXPECT_EQ(prefill_only.decode_seconds(), 0);
  EXPECT_EQ(prefill_only.prompt_tokens(0), 512);
}

}  // namespace q3vl
