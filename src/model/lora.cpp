// LoRA adapters beside the linears they wrap (model/lora.hpp): deck section, target matching, sizing, the dropout
// key, merging.
#include "q3vl/model/lora.hpp"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/hash.hpp"
#include "q3vl/model/params.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl {

double LoraConfig::scale() const { return rank <= 0 ? 0.0 : rslora ? alpha / std::sqrt(double(rank)) : alpha / rank; }

static bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

static std::vector<std::string> split_targets(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) fail_all("lora.targets: empty pattern in '" + text + "'");
    out.push_back(item.substr(a, b - a + 1));
  }
  if (out.empty()) fail_all("lora.targets is empty: name at least one module pattern (e.g. q_proj)");
  return out;
}

// A key differing from its default. Deck::given() cannot tell: the resolved deck that ranks receive names every key.
static bool set_in(const Deck& d, const std::string& key) {
  const KeySpec* k = find_key(key);
  switch (k->type) {
    case KeyType::Int: return d.integer(key) != std::stoll(k->def);
    case KeyType::Real: return d.real(key) != std::stod(k->def);
    case KeyType::Bool: return d.boolean(key) != (k->def == "true");
    case KeyType::String: return d.str(key) != k->def;
  }
  return true;
}

// lora.adapter's adapter_config.json fills what the deck leaves out (an eval or generate names only the folder);
// what both give must agree.
static void merge_adapter_config(LoraConfig& c, const Deck& d) {
  const std::string dir = d.str("lora.adapter"), path = dir + "/adapter_config.json";
  std::ifstream in(path);
  if (!in) fail_all("lora.adapter: cannot read '" + path + "' (a PEFT adapter folder holds adapter_config.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail_all("lora.adapter: '" + path + "' is not valid JSON: " + e.what());
  }
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) fail_all("lora.adapter: '" + path + "' has no \"" + key + "\"");
    return j[key];
  };
  try {
    const int r = need("r").get<int>();
    const double alpha = need("lora_alpha").get<double>();
    const bool rs = j.value("use_rslora", false);
    std::vector<std::string> targets;
    const auto& t = need("target_modules");
    if (t.is_string()) fail_all("lora.adapter: '" + path + "': target_modules as a regex is not supported, only a list");
    for (const auto& x : t) targets.push_back(x.get<std::string>());
    auto clash = [&](const char* key, const std::string& deck, const std::string& file) {
      fail_all(std::string(key) + " = " + deck + " but the adapter '" + path + "' says " + file);
    };
    if (set_in(d, "lora.rank") && c.rank != r) clash("lora.rank", std::to_string(c.rank), "r = " + std::to_string(r));
    if (set_in(d, "lora.alpha") && c.alpha != alpha) clash("lora.alpha", std::to_string(c.alpha), "lora_alpha = " + std::to_string(alpha));
    if (set_in(d, "lora.rslora") && c.rslora != rs) clash("lora.rslora", c.rslora ? "true" : "false", rs ? "use_rslora = true" : "use_rslora = false");
    c.rank = r;
    c.alpha = alpha;
    c.rslora = rs;
    if (!set_in(d, "lora.targets")) c.targets = targets;  // the adapter's own (exact module names)
    if (j.contains("lora_dropout") && !set_in(d, "lora.dropout")) c.dropout = j["lora_dropout"].get<double>();
  } catch (const nlohmann::json::exception& e) {
    fail_all("lora.adapter: '" + path + "': " + e.what());
  }
}

LoraConfig lora_config(const Deck& d) {
  LoraConfig c;
  c.rank = int(d.integer("lora.rank"));
  c.alpha = d.real("lora.alpha");
  c.dropout = d.real("lora.dropout");
  c.rslora = d.boolean("lora.rslora");
  c.targets = split_targets(d.str("lora.targets"));
  if (!d.str("lora.adapter").empty()) merge_adapter_config(c, d);
  if (c.rank == 0) {
    for (const char* k : {"lora.alpha", "lora.dropout", "lora.targets", "lora.rslora"})
      if (set_in(d, k)) fail_all(std::string(k) + " is set but lora.rank = 0 (no adapters): set lora.rank > 0");
    return LoraConfig{};
  }
  if (!(c.alpha > 0)) fail_all("lora.alpha must be > 0 with lora.rank > 0");
  return c;
}

// PEFT: a list entry matches a module whose name equals it or ends with "." + it; we add '*' (any run of characters).
static bool glob(const char* p, const char* s) {
  if (!*p) return !*s;
  if (*p == '*') return glob(p + 1, s) || (*s && glob(p, s + 1));
  return *s == *p && glob(p + 1, s + 1);
}
bool lora_pattern_match(const std::string& pattern, const std::string& module) {
  if (pattern.find('*') != std::string::npos)
    return glob(pattern.c_str(), module.c_str()) || glob(("*." + pattern).c_str(), module.c_str());
  return module == pattern || ends_with(module, "." + pattern);
}

static const char* const kEligible[] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj",    "mlp.gate",         "attn.qkv",         "attn.proj",        "linear_fc1",    "linear_fc2"};

bool lora_eligible(const std::string& n) {
  if (n.find(".lora_") != std::string::npos) return false;
  for (const char* s : kEligible)
    if (ends_with(n, std::string(".") + s + ".weight")) return true;
  return false;
}

bool lora_standard_module(const std::string& pattern) {
  for (const char* s : kEligible) {
    const std::string e = s;
    if (e == pattern || ends_with(e, "." + pattern)) return true;
  }
  return pattern == "merger.linear_fc1" || pattern == "merger.linear_fc2" || pattern == "mlp.linear_fc1" ||
         pattern == "mlp.linear_fc2";
}

std::string peft_name(const std::string& table_name) { return "base_model.model." + table_name; }

LoraSize lora_size(const ModelConfig& cfg) {
  const ParamTable t(cfg);  // names and shapes only: no tensor is allocated
  LoraSize s;
  for (const ParamInfo& p : t.params()) {
    if (p.part == Part::Lora) s.params += p.numel;
    else s.base += p.numel;
  }
  for (size_t i = 0; i < t.params().size(); ++i) s.wrapped += t.lora_a(int(i)) >= 0;
  return s;
}

// ---- forward and backward ----------------------------------------------------------------------------------

uint64_t lora_dropout_key(uint64_t seed, uint64_t nonce, int a) {
  return splitmix64(splitmix64(seed ^ splitmix64(nonce)) ^ uint64_t(a));
}

template <class T> int lora_merge(const ParamTable& t, double scale, T* const* params, T* untied_head) {
  const int head = t.lora_a(t.lm_head());
  if (head >= 0 && lora_tied_head(t, head) && !untied_head)  // before anything is changed
    fail("lora: the LM head's adapter cannot be folded into a tied head (the input embeddings would change too): "
         "untie it, giving the head its own copy of the embeddings");
  int merged = 0;
  for (size_t id = 0; id < t.params().size(); ++id) {
    const int a = t.lora_a(int(id));
    if (a < 0) continue;
    const int64_t r = t.param(a).shape[0], in = t.param(a).shape[1], out = t.param(a + 1).shape[0];
    T* W = params[id];
    if (lora_tied_head(t, a)) W = untied_head;  // W is the embedding too: the adapter adapts the output side only
    ops::gemm(false, false, out, in, r, T(scale), params[a + 1], r, params[a], in, T(1), W, in);
    ++merged;
  }
  return merged;
}

bool lora_tied_head(const ParamTable& t, int a) {
  return t.lora_base(a) == t.lm_head() && t.lm_head() == t.embed_tokens();
}

template int lora_merge<float>(const ParamTable&, double, float* const*, float*);
template int lora_merge<double>(const ParamTable&, double, double* const*, double*);

}  // namespace q3vl
