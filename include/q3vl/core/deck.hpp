// The input deck: TOML read with toml++, checked against one schema that declares every key (section,
// type, default, range or choices, the modes that require it, one-line help). Command-line overrides
// `section.key=value` pass the same checks. Rank 0 parses; the resolved deck travels to the other ranks
// as TOML text (runtime/ does the broadcast) and is echoed at the top of the log and stored in checkpoints.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace q3vl {

enum class KeyType { Bool, Int, Real, String };

struct KeySpec {
  std::string name;                  // "section.key"
  KeyType type;
  std::string def;                   // default as text ("" for strings means empty); ignored when required
  std::string help;
  double min = -1e300, max = 1e300;  // for Int and Real
  std::vector<std::string> choices;  // for String (empty: any)
  std::vector<std::string> required_in;  // modes in which the key must be given
};

// Every key q3vl understands. The single source for parsing, `q3vl help deck` and validation.
const std::vector<KeySpec>& deck_schema();
const KeySpec* find_key(const std::string& name);
// Closest valid key name (edit distance), for "did you mean" in messages.
std::string closest_key(const std::string& name);

using DeckValue = std::variant<bool, int64_t, double, std::string>;

class Deck {
 public:
  // Parse a deck file (path may be empty: defaults only), apply overrides, validate for `mode`.
  // Throws q3vl::Error with file:line:col (or "command line") on any problem.
  static Deck load(const std::string& path, const std::vector<std::string>& overrides, const std::string& mode);
  // Parse TOML text (a resolved deck from rank 0, or a checkpoint's copy); `origin` names it in messages.
  static Deck parse(const std::string& toml_text, const std::string& origin, const std::vector<std::string>& overrides,
                    const std::string& mode);

  bool boolean(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double real(const std::string& key) const;
  const std::string& str(const std::string& key) const;
  bool given(const std::string& key) const;  // set by the file or the command line (not a default)
  // The given keys, one per line, and their restoration on a deck parsed from another's to_toml() (which writes
  // defaults too): what Runtime::load_deck broadcasts with the resolved text.
  std::string given_keys() const;
  void set_given_keys(const std::string& lines);

  // Set a value programmatically (checked like an override).
  void set(const std::string& key, const std::string& value_text);

  // The resolved deck as TOML text, every key with its value (parses back to an identical deck). hide_secrets: keys
  // named *api_key read "<hidden>" (the log's echo and checkpoints, which others read).
  std::string to_toml(bool hide_secrets = false) const;

 private:
  const DeckValue& get(const std::string& key, KeyType type) const;
  std::map<std::string, DeckValue> values_;
  std::map<std::string, bool> given_;
};

// `q3vl help deck`: the schema as readable text.
std::string deck_help();

}  // namespace q3vl
