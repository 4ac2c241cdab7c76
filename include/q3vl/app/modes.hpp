// The modes `q3vl MODE` can run. Each mode lives in its own layer (train/, serve/, data/, ...); this
// table only names them.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "q3vl/core/deck.hpp"

namespace q3vl {

struct ModeArgs {
  std::vector<std::string> flags;  // "--decode" and the like, checked against Mode::flags
  bool has(const std::string& f) const;
};

struct Mode {
  std::string name, help;
  std::function<int(const Deck&, const ModeArgs&)> run;
  std::vector<std::string> flags;  // flags the mode accepts
  bool quiet = false;              // no banner or deck echo (modes whose stdout is data)
};

const std::vector<Mode>& modes();

class Comm;
// Every path argument the mode uses is what it must be (file, folder, writable), before any work; collective over
// `world`, the error printed once. (prepare.output has its own rules: prepare_dataset.)
void check_paths(const Deck& deck, const std::string& mode, Comm& world);
const Mode* find_mode(const std::string& name);

}  // namespace q3vl
