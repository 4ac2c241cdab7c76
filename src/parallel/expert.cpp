#include "q3vl/parallel/expert.hpp"

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"

namespace q3vl {

std::string expert_layout_error(const ModelConfig& cfg, int world, int ep) {
  const std::string key = "parallel.ep = " + std::to_string(ep);
  if (ep < 1) return key + ": must be at least 1";
  if (ep == 1) return "";
  if (!cfg.moe()) return key + ": the model is dense (no experts to split); use parallel.ep = 1";
  if (world % ep)
    return key + " does not divide the " + std::to_string(world) + " ranks (EP groups are ep consecutive ranks)";
  if (cfg.text.num_experts % ep)
    return key + " does not divide the model's " + std::to_string(cfg.text.num_experts) + " experts per layer";
  return "";
}

ExpertParallel::ExpertParallel(Comm& world, int ep) {
  Q3VL_CHECK(ep >= 1 && world.size() % ep == 0, "ExpertParallel: ep must divide the world size");
  group_ = world.split(world.rank() / ep, world.rank());
  replicas_ = world.split(world.rank() % ep, world.rank());
  scales_.assign(size_t(ep), 1.0);
}

void ExpertParallel::rows(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                          const std::vector<int64_t>& recv_rows, int64_t width, DType t) {
  const double t0 = wall_seconds();
  const size_t n = size_t(size());
  std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
  for (size_t p = 0, s = 0, r = 0; p < n; ++p) {
    sc[p] = size_t(send_rows[p] * width), sd[p] = s, s += sc[p];
    rc[p] = size_t(recv_rows[p] * width), rd[p] = r, r += rc[p];
  }
  (rows_comm_ ? *rows_comm_ : *group_).all_to_allv(send, sc, sd, recv, rc, rd, t);
  seconds_ += wall_seconds() - t0;
}

void ExpertParallel::set_rows_comm(Comm* c) {
  Q3VL_CHECK(!c || (c->size() == size() && c->rank() == rank()), "ExpertParallel: a rows communicator of other ranks");
  rows_comm_ = c;
}

void ExpertParallel::counts(const int64_t* send, int64_t* recv, int64_t n) {
  const double t0 = wall_seconds();
  group_->all_to_all(send, recv, size_t(n), DType::I64);
  seconds_ += wall_seconds() - t0;
}

void ExpertParallel::set_scale(double s) { group_->all_gather(&s, scales_.data(), 1, DType::F64); }

}  // namespace q3vl
