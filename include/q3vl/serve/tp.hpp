// Tensor parallelism for serving (Megatron-LM's layout) over the ranks of a group: rank r of tp holds query heads
// [r*nh/tp, (r+1)*nh/tp) with the key/value heads they read (a kv head is replicated when tp > kv_heads, as vLLM
// does), q/k/v and gate/up split by rows (column-parallel), o_proj and down_proj split by columns (row-parallel,
// their partial outputs summed over the group), and the LM head's vocabulary rows split (vocab-parallel; the tied
// embedding stays whole on every rank). A MoE layer keeps the router whole on every rank, so each rank routes alike,
// and splits its experts over the group: with serve.ep = 1 every expert's rows the same way as the dense MLP's; with
// serve.ep = P (dividing tp) into P sets of E/P whole experts, each set's rows split over tp/P ranks (P = tp: whole
// experts, vLLM's expert parallelism). A rank runs only the rows routed to its experts; the group's one sum after the
// block completes every token, as it completes a dense layer. The vision tower is not split: rank 0 runs it and
// sends each step's image features with the step, which costs one broadcast of n_image_tokens x hidden floats instead
// of a whole tower per rank.
#pragma once
#include <cstdint>
#include <string>
#include <functional>
#include <vector>
#include <utility>

#include "q3vl/core/deck.hpp"
#include "q3vl/model/dev_model.hpp"
#include "q3vl/model/weights.hpp"

namespace q3vl {

// serve's layout of `world` ranks on `nodes` nodes: serve.tp x serve.pp (0: auto). Auto: pipeline stages across nodes
// and tensor parallelism within one (the inter-node links carry a step's hidden states once per stage instead of two
// all-reduces per layer), with at least one layer per stage; else tensor parallelism over all ranks. `why` says what
// was picked and why. Fails naming the keys when the product is not the rank count, and when stages outnumber the
// layers.
struct ServeLayout {
  int tp = 1, pp = 1;
  std::string why;
};
ServeLayout serve_layout(int world, int nodes, int tp_key, int pp_key, int layers);
// What the device model is sized for under the deck's serve.* keys (serve and the planner alike): a step of
// serve.step_tokens tokens (at least one per sequence) in up to serve.max_batch sequences, a vision pass for a prompt
// as long as serve.max_context, blocks of serve.kv_block tokens; no KV blocks yet (serve sizes them from what is left).
DevModel::InferBudget serve_budget(const Deck& d);

// The decoder shape rank `rank` of `size` holds, `ep` of them splitting the experts (serve.ep); fails naming what does
// not divide (heads, kv heads, intermediate, experts, each expert's intermediate). Its table holds tp_experts' share
// of the experts: ParamTable(tp_config(full, r, n, ep), tp_experts(r, n, ep)).
ModelConfig tp_config(const ModelConfig& full, int rank, int size, int ep = 1);
ExpertSplit tp_experts(int rank, int size, int ep);
// The pieces of full's tensors that rank `rank` of `size` holds, as slices of the full table (elements of a full
// tensor, row-major) with their places in the local model's parameters (local: the table of tp_config's slice):
// dst_of(id) is where local parameter id starts, null to leave it out. A row-parallel weight is one slice per row.
std::vector<ParamSlice> tp_slices(const ParamTable& full, const ParamTable& local, int rank, int size,
                                  const std::function<float*(int)>& dst_of, int ep = 1);
// Copies this rank's slices of full's weights into local (built from tp_config and tp_experts).
void tp_shard_weights(const HostWeights& full, HostWeights& local, int rank, int size, int ep = 1);
// KV-cache bytes of one token on one rank of a TP group: keys and values of the kv heads it holds (one when there
// are more ranks than kv heads), for `layers` layers, `elem` bytes each. serve sizes its cache and `q3vl plan`
// its serve layouts with it.
int64_t tp_kv_bytes_per_token(const TextConfig& t, int size, int layers, int elem);
// Vocabulary rows [v0, v1) of this rank's LM-head slice.
std::pair<int64_t, int64_t> tp_vocab_rows(int64_t vocab, int rank, int size);

}  // namespace q3vl
