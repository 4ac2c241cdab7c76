#include "q3vl/app/modes.hpp"

#include <algorithm>

#include "q3vl/runtime/check.hpp"

namespace q3vl {

bool ModeArgs::has(const std::string& f) const { return std::find(flags.begin(), flags.end(), f) != flags.end(); }

const std::vector<Mode>& modes() {
  static const std::vector<Mode> table = {
      {"check", "preflight: every rank's host, device, memory and disk; all-reduce bandwidth between ranks",
       [](const Deck& d, const ModeArgs&) { return run_check(d); }},
  };
  return table;
}

const Mode* find_mode(const std::string& name) {
  for (const auto& m : modes())
    if (m.name == name) return &m;
  return nullptr;
}

}  // namespace q3vl
