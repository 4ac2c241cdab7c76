#include "q3vl/core/deck.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <toml++/toml.h>

#include "q3vl/core/error.hpp"
#include "q3vl/core/paths.hpp"

namespace q3vl {

namespace {

const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::Bool: return "a boolean (true/false)";
    case KeyType::Int: return "an integer";
    case KeyType::Real: return "a number";
    case KeyType::String: return "a string";
  }
  return "?";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> sections() {
  std::vector<std::string> out;
  for (const auto& k : deck_schema()) {
    std::string s = k.name.substr(0, k.name.find('.'));
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

std::string closest_of(const std::string& name, const std::vector<std::string>& options) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& o : options) {
    size_t d = edit_distance(name, o);
    if (d < best_d) best_d = d, best = o;
  }
  return best;
}

// Check range/choices of an already typed value. `where` prefixes the message.
void check_value(const KeySpec& k, const DeckValue& v, const std::string& where) {
  auto out_of_range = [&](const std::string& shown) {
    std::ostringstream m;
    m << where << ": " << k.name << " = " << shown << " is out of range [" << k.min << ", " << k.max << "]";
    fail_all(m.str());
  };
  if (k.type == KeyType::Int) {
    int64_t x = std::get<int64_t>(v);
    if (double(x) < k.min || double(x) > k.max) out_of_range(std::to_string(x));
  } else if (k.type == KeyType::Real) {
    double x = std::get<double>(v);
    if (!std::isfinite(x) || x < k.min || x > k.max) {
      std::ostringstream s;
      s << x;
      out_of_range(s.str());
    }
  } else if (k.type == KeyType::String && !k.choices.empty()) {
    const auto& s = std::get<std::string>(v);
    if (std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end()) {
      std::string list;
      for (const auto& c : k.choices) list += (list.empty() ? "\"" : ", \"") + c + "\"";
      fail_all(where + ": " + k.name + " = \"" + s + "\" is not one of " + list);
    }
  }
}

DeckValue parse_default(const KeySpec& k) {
  switch (k.type) {
    case KeyType::Bool: return k.def == "true";
    case KeyType::Int: return int64_t(std::stoll(k.def));
    case KeyType::Real: return std::stod(k.def);
    // The default tokenizer ships with q3vl: found from any working directory (core/paths.hpp).
    case KeyType::String: return k.name == "tokenizer.path" ? shipped_file(k.def, "share/q3vl/tokenizer.json") : k.def;
  }
  return k.def;
}

// Text of a command-line override to a typed value.
DeckValue parse_text(const KeySpec& k, std::string text, const std::string& where) {
  auto bad = [&]() -> DeckValue {
    fail_all(where + ": " + k.name + " expects " + type_name(k.type) + ", got '" + text + "'");
  };
  switch (k.type) {
    case KeyType::Bool:
      if (text == "true") return true;
      if (text == "false") return false;
      return bad();
    case KeyType::Int: {
      int64_t x = 0;
      auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
      if (ec != std::errc() || p != text.data() + text.size() || text.empty()) return bad();
      return x;
    }
    case KeyType::Real: {
      char* end = nullptr;
      double x = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size()) return bad();
      return x;
    }
    case KeyType::String:
      if (text.size() >= 2 && text.front() == '"' && text.back() == '"') text = text.substr(1, text.size() - 2);
      return text;
  }
  return bad();
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += char(c);
    else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += char(c);
  }
  return out + "\"";
}

std::string value_text(const DeckValue& v) {
  if (auto b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto d = std::get_if<double>(&v)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", *d);
    std::string s = buf;
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stay a TOML float
    return s;
  }
  return quote(std::get<std::string>(v));
}

std::string at(const std::string& origin, const toml::source_region& r) {
  return origin + ":" + std::to_string(r.begin.line) + ":" + std::to_string(r.begin.column);
}

}  // namespace

const KeySpec* find_key(const std::string& name) {
  for (const auto& k : deck_schema())
    if (k.name == name) return &k;
  return nullptr;
}

std::string closest_key(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& k : deck_schema()) names.push_back(k.name);
  return closest_of(name, names);
}

Deck Deck::load(const std::string& path, const std::vector<std::string>& overrides, const std::string& mode) {
  std::string text;
  if (!path.empty()) {
    // An ifstream opens a folder and reads nothing: that would run on the defaults.
    if (std::filesystem::is_directory(path)) fail_all("deck '" + path + "' is a folder; it must be a TOML file");
    std::ifstream f(path, std::ios::binary);
    if (!f) fail_all("cannot open deck '" + path + "'");
    std::ostringstream ss;
    ss << f.rdbuf();
    text = ss.str();
  }
  return parse(text, path.empty() ? "<defaults>" : path, overrides, mode);
}

Deck Deck::parse(const std::string& toml_text, const std::string& origin, const std::vector<std::string>& overrides,
                 const std::string& mode) {
  Deck d;
  for (const auto& k : deck_schema()) d.values_[k.name] = parse_default(k);

  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    fail_all(at(origin, e.source()) + ": syntax error: " + std::string(e.description()));
  }
  const auto secs = sections();
  for (auto&& [skey, snode] : root) {
    std::string sname(skey.str());
    if (!snode.is_table()) {
      fail_all(at(origin, snode.source()) + ": '" + sname + "' must be a [section]; keys live in sections (" +
               "did you mean '" + closest_key(sname) + "'?)");
    }
    if (std::find(secs.begin(), secs.end(), sname) == secs.end())
      fail_all(at(origin, snode.source()) + ": unknown section [" + sname + "] (did you mean [" +
               closest_of(sname, secs) + "]?)");
    for (auto&& [kkey, node] : *snode.as_table()) {
      std::string name = sname + "." + std::string(kkey.str());
      const KeySpec* k = find_key(name);
      std::string where = at(origin, node.source());
      if (!k)
        fail_all(at(origin, kkey.source()) + ": unknown key '" + name + "' (did you mean '" + closest_key(name) +
                 "'?)");
      DeckValue v;
      if (k->type == KeyType::Bool && node.is_boolean()) v = node.as_boolean()->get();
      else if (k->type == KeyType::Int && node.is_integer()) v = node.as_integer()->get();
      else if (k->type == KeyType::Real && node.is_integer()) v = double(node.as_integer()->get());
      else if (k->type == KeyType::Real && node.is_floating_point()) v = node.as_floating_point()->get();
      else if (k->type == KeyType::String && node.is_string()) v = node.as_string()->get();
      else fail_all(where + ": " + name + " expects " + type_name(k->type));
      check_value(*k, v, where);
      d.values_[name] = v;
      d.given_[name] = true;
    }
  }
  for (const auto& o : overrides) {
    size_t eq = o.find('=');
    if (eq == std::string::npos) fail_all("command line: '" + o + "' is not of the form section.key=value");
    d.set(o.substr(0, eq), o.substr(eq + 1));
  }

  for (const auto& k : deck_schema())
    if (std::find(k.required_in.begin(), k.required_in.end(), mode) != k.required_in.end() && !d.given(k.name))
      fail_all(origin + ": missing required key '" + k.name + "' for mode " + mode + " (" + k.help +
               "); set it in the deck or on the command line as " + k.name + "=...");
  return d;
}

void Deck::set(const std::string& key, const std::string& value_text) {
  std::string where = "command line: '" + key + "=" + value_text + "'";
  if (key.empty()) fail_all(where + ": the override lacks a key (the form is section.key=value)");
  const KeySpec* k = find_key(key);
  if (!k) fail_all(where + ": unknown key '" + key + "' (did you mean '" + closest_key(key) + "'?)");
  DeckValue v = parse_text(*k, value_text, where);
  check_value(*k, v, where);
  values_[key] = v;
  given_[key] = true;
}

const DeckValue& Deck::get(const std::string& key, KeyType type) const {
  const KeySpec* k = find_key(key);
  Q3VL_CHECK(k && k->type == type, "deck key '" + key + "' is not declared with this type in deck_schema()");
  return values_.at(key);
}

bool Deck::boolean(const std::string& key) const { return std::get<bool>(get(key, KeyType::Bool)); }
int64_t Deck::integer(const std::string& key) const { return std::get<int64_t>(get(key, KeyType::Int)); }
double Deck::real(const std::string& key) const { return std::get<double>(get(key, KeyType::Real)); }
const std::string& Deck::str(const std::string& key) const { return std::get<std::string>(get(key, KeyType::String)); }
bool Deck::given(const std::string& key) const { return given_.count(key) > 0; }

std::string Deck::given_keys() const {
  std::string out;
  for (const auto& [k, on] : given_)
    if (on) out += k + "\n";
  return out;
}

void Deck::set_given_keys(const std::string& lines) {
  given_.clear();
  std::istringstream in(lines);
  for (std::string k; std::getline(in, k);)
    if (!k.empty()) given_[k] = true;
}

std::string Deck::to_toml(bool hide_secrets) const {
  std::ostringstream out;
  std::string section;
  for (const auto& k : deck_schema()) {
    std::string s = k.name.substr(0, k.name.find('.'));
    if (s != section) out << (section.empty() ? "" : "\n") << "[" << s << "]\n", section = s;
    const auto* str = std::get_if<std::string>(&values_.at(k.name));
    const bool secret = hide_secrets && k.name.ends_with("api_key") && str && !str->empty();
    out << k.name.substr(s.size() + 1) << " = " << (secret ? "\"<hidden>\"" : value_text(values_.at(k.name))) << "\n";
  }
  return out.str();
}

std::string deck_help() {
  std::ostringstream out;
  out << "q3vl input deck (TOML). Every key, its type, default and meaning; any key can be overridden on the\n"
         "command line as section.key=value.\n";
  std::string section;
  for (const auto& k : deck_schema()) {
    std::string s = k.name.substr(0, k.name.find('.'));
    if (s != section) out << "\n[" << s << "]\n", section = s;
    std::string key = k.name.substr(s.size() + 1);
    std::string type = k.type == KeyType::Bool ? "bool" : k.type == KeyType::Int ? "int" : k.type == KeyType::Real ? "real" : "string";
    out << "  " << key << " (" << type;
    if (k.type == KeyType::String) out << ", default " << quote(k.def);
    else out << ", default " << k.def;
    if ((k.type == KeyType::Int || k.type == KeyType::Real) && (k.min > -1e299 || k.max < 1e299))
      out << ", range [" << k.min << ", " << k.max << "]";
    if (!k.choices.empty()) {
      out << ", one of";
      for (const auto& c : k.choices) out << " " << quote(c);
    }
    if (!k.required_in.empty()) {
      out << ", required for";
      for (const auto& m : k.required_in) out << " " << m;
    }
    out << ")\n      " << k.help << "\n";
  }
  return out.str();
}

}  // namespace q3vl
