#include "q3vl/serve/tp.hpp"

#include <algorithm>
#include <functional>
#include <string>

#include "q3vl/core/error.hpp"

namespace q3vl {

ExpertSplit tp_experts(int rank, int size, int ep) {
  if (ep < 1 || size % ep)
    fail("serve.ep = " + std::to_string(ep) + " must divide serve.tp = " + std::to_string(size) +
         " (its ranks split the experts)");
  return {ep, rank / (size / ep)};
}

namespace {
struct Split {
  int64_t q0, nq, kv0, nkv, i0, ni;  // query heads, kv heads, MLP rows of this rank
  int64_t e0, ne, m0, nm;            // MoE: its experts, and each one's rows it holds
};
Split split(const TextConfig& t, int rank, int size, int ep) {
  const std::string tp = "serve.tp = " + std::to_string(size);
  if (t.heads % size) fail(tp + " does not divide the " + std::to_string(t.heads) + " attention heads");
  if (t.intermediate % size) fail(tp + " does not divide the MLP's " + std::to_string(t.intermediate) + " rows");
  if (size <= t.kv_heads ? t.kv_heads % size : size % t.kv_heads)
    fail(tp + " and the " + std::to_string(t.kv_heads) + " key/value heads: one must divide the other");
  const std::string eps = "serve.ep = " + std::to_string(ep);
  const ExpertSplit experts = tp_experts(rank, size, ep);  // fails unless ep divides size
  if (ep > 1 && t.num_experts == 0) fail(eps + ": the model is dense (no experts to split); use serve.ep = 1");
  if (t.num_experts > 0 && t.num_experts % ep)
    fail(eps + " does not divide the " + std::to_string(t.num_experts) + " experts");
  const int rows_split = size / ep;  // ranks that split each expert's rows
  if (t.num_experts > 0 && t.moe_intermediate % rows_split)
    fail(tp + (ep > 1 ? " / " + eps : "") + " does not divide each expert's " + std::to_string(t.moe_intermediate) +
         " rows");
  Split s;
  s.nq = t.heads / size, s.q0 = rank * s.nq;
  s.nkv = std::max(1, t.kv_heads / size);
  s.kv0 = size <= t.kv_heads ? rank * s.nkv : s.q0 / (t.heads / t.kv_heads);  // replicated: the group of its queries
  s.ni = t.intermediate / size, s.i0 = rank * s.ni;
  s.ne = t.num_experts / ep, s.e0 = experts.rank * s.ne;
  s.nm = t.moe_intermediate / rows_split, s.m0 = rank % rows_split * s.nm;
  return s;
}
}  // namespace

ServeLayout serve_layout(int world, int nodes, int tp_key, int pp_key, int layers) {
  ServeLayout l;
  l.pp = pp_key, l.tp = tp_key;
  if (l.pp == 0) {
    if (l.tp != 0) l.pp = l.tp > 0 && world % l.tp == 0 ? world / l.tp : 0;
    else if (nodes > 1 && world % nodes == 0 && nodes <= layers) l.pp = nodes;
    else l.pp = 1;
  }
  if (l.tp == 0 && l.pp > 0) l.tp = world / l.pp;
  if (l.pp <= 0 || l.tp * l.pp != world)
    fail("serve.tp = " + std::to_string(tp_key) + " and serve.pp = " + std::to_string(pp_key) + " with " +
         std::to_string(world) + " ranks: serve.tp x serve.pp must be the number of ranks (0: auto; replicas of a "
         "group are not supported yet)");
  if (l.pp > layers)
    fail("serve.pp = " + std::to_string(l.pp) + ": more stages than the model's " + std::to_string(layers) + " layers");
  const std::string picked = "TP " + std::to_string(l.tp) + " x PP " + std::to_string(l.pp) + " over " +
                             std::to_string(world) + " rank(s) on " + std::to_string(nodes) + " node(s)";
  if (pp_key == 0 && tp_key == 0)
    l.why = "serve: layout auto: " + picked +
            (l.pp > 1 ? ": tensor parallel within a node, pipeline stages across nodes" : ": tensor parallel over all");
  else
    l.why = "serve: layout " + picked + " (serve.tp, serve.pp)";
  return l;
}

DevModel::InferBudget serve_budget(const Deck& d) {
  const int64_t ctx = d.integer("serve.max_context"), block = d.integer("serve.kv_block");
  DevModel::InferBudget b;
  b.segments = d.integer("serve.max_batch");
  b.tokens = std::max(d.integer("serve.step_tokens"), b.segments);  // decodes go first, chunks fill to step_tokens
  b.patches = 4 * ctx;  // a merged image token is 4 patches, and a request's image tokens fit in its context
  b.block = block;
  b.seq_blocks = (ctx + block - 1) / block + 1;
  return b;
}

ModelConfig tp_config(const ModelConfig& full, int rank, int size, int ep) {
  const Split s = split(full.text, rank, size, ep);
  ModelConfig c = full;
  c.text.heads = (int)s.nq;
  c.text.kv_heads = (int)s.nkv;
  c.text.intermediate = (int)s.ni;
  c.text.moe_intermediate = (int)s.nm;
  return c;
}

int64_t tp_kv_bytes_per_token(const TextConfig& t, int size, int layers, int elem) {
  return 2 * int64_t(std::max(1, t.kv_heads / size)) * t.head_dim * layers * elem;
}

std::pair<int64_t, int64_t> tp_vocab_rows(int64_t vocab, int rank, int size) {
  const int64_t per = (vocab + size - 1) / size;
  return {std::min(vocab, rank * per), std::min(vocab, (rank + 1) * per)};
}

std::vector<ParamSlice> tp_slices(const ParamTable& full, const ParamTable& local, int rank, int size,
                                  const std::function<float*(int)>& dst_of, int ep) {
  const TextConfig& t = full.config().text;
  const Split s = split(t, rank, size, ep);
  const int64_t hd = t.head_dim;
  for (int l = 0; l < t.layers; ++l)
    if (local.layer(l) != full.layer(l)) fail("tp: the local parameter table differs from the full one");
  const ExpertSplit mine = t.num_experts ? tp_experts(rank, size, ep) : ExpertSplit{};
  if (local.ep().size != mine.size || local.ep().rank != mine.rank)
    fail("tp: the local parameter table holds another share of the experts than serve.ep = " + std::to_string(ep) +
         " gives rank " + std::to_string(rank) + " of " + std::to_string(size));
  std::vector<ParamSlice> out;
  for (size_t id = 0; id < full.params().size(); ++id) {
    const ParamInfo& pf = full.params()[id];
    const ParamInfo& pl = local.params()[id];
    float* dst = dst_of((int)id);
    if (!dst) continue;
    if (pf.shape == pl.shape && pl.held == pf.numel) {
      out.push_back({(int)id, 0, pf.numel, dst});
      continue;
    }
    // Which decoder tensor: its offset from its layer's first id.
    int which = -1;
    for (int l = 0; l < t.layers && which < 0; ++l)
      if ((int)id >= full.layer(l) && (int)id < full.layer(l) + tlay::count) which = (int)id - full.layer(l);
    // Experts [E, rows, cols]: this rank's experts [e0, e0 + ne) (serve.ep), each split like a dense weight; a 2-D
    // weight is one "expert".
    const bool experts = pf.shape.size() == 3;
    const int64_t e0 = experts ? s.e0 : 0, ne = experts ? s.ne : 1, rows = pf.shape[experts], cols = pf.shape[experts + 1];
    const int64_t per = pl.held / ne;  // elements of one expert's slice
    auto take_rows = [&](int64_t r0, int64_t n, int64_t at = 0) {
      for (int64_t e = 0; e < ne; ++e)
        out.push_back({(int)id, ((e0 + e) * rows + r0) * cols, n * cols, dst + e * per + at * cols});
    };
    auto take_cols = [&](int64_t c0, int64_t n) {
      for (int64_t e = 0; e < ne; ++e)
        for (int64_t r = 0; r < rows; ++r)
          out.push_back({(int)id, ((e0 + e) * rows + r) * cols + c0, n, dst + e * per + r * n});
    };
    switch (which) {
      case tlay::q_proj: take_rows(s.q0 * hd, s.nq * hd); break;
      case tlay::k_proj:
      case tlay::v_proj: take_rows(s.kv0 * hd, s.nkv * hd); break;
      case tlay::o_proj: take_cols(s.q0 * hd, s.nq * hd); break;
      case tlay::gate_proj:  // the router when MoE: whole on every rank, taken above
      case tlay::up_proj:
        if (!experts) take_rows(s.i0, s.ni);
        else take_rows(s.m0, s.nm), take_rows(rows / 2 + s.m0, s.nm, s.nm);  // gate rows, then up rows
        break;
      case tlay::down_proj: experts ? take_cols(s.m0, s.nm) : take_cols(s.i0, s.ni); break;
      default: fail("tp: no rule to split " + pf.name);
    }
  }
  return out;
}

void tp_shard_weights(const HostWeights& full, HostWeights& local, int rank, int size, int ep) {
  for (const ParamSlice& p :
       tp_slices(full.table(), local.table(), rank, size, [&](int id) { return local.param(id); }, ep)) {
    const float* src = full.param(p.param) + p.begin;
    std::copy(src, src + p.count, p.dst);
  }
}

}  // namespace q3vl
