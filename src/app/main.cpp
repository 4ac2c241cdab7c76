// q3vl MODE [DECK] [section.key=value ...]
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "q3vl/app/modes.hpp"
#include "q3vl/core/debug.hpp"
#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/runtime/runtime.hpp"

#ifndef Q3VL_GIT
#define Q3VL_GIT "unknown"
#endif

namespace q3vl {
namespace {

const char* kVersion = "0.1.0";

std::string version_line() {
  std::string v = std::string("q3vl ") + kVersion + " (git " + Q3VL_GIT + ", backends: cpu";
#ifdef Q3VL_CUDA
  v += ", cuda";
#endif
  return v + ")";
}

void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: q3vl MODE [DECK] [section.key=value ...] [--flags]\n"
               "       q3vl --help | --version | help deck\n\n"
               "Run under MPI with one rank per GPU (or per CPU core group): mpiexec -n 4 bin/q3vl MODE ...\n\n"
               "modes:\n");
  for (const auto& m : modes()) std::fprintf(to, "  %-10s %s\n", m.name.c_str(), m.help.c_str());
  std::fprintf(to, "\nThe deck is TOML; `q3vl help deck` lists every key. Output goes to run.out_dir (default out/).\n");
}

int dispatch(int argc, char** argv) {
  std::string mode = argv[1];
  const Mode* m = find_mode(mode);
  if (!m) {
    std::string list;
    for (const auto& x : modes()) list += (list.empty() ? "" : ", ") + x.name;
    fail_all("unknown mode '" + mode + "' (modes: " + list + "; see q3vl --help)");
  }
  std::string deck_path;
  std::vector<std::string> overrides, flags;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) flags.push_back(a);
    else if (a.find('=') != std::string::npos) overrides.push_back(a);
    else if (deck_path.empty()) deck_path = a;
    else fail_all("unexpected argument '" + a + "': only one deck may be given (overrides are section.key=value)");
  }
  for (const auto& f : flags)
    if (std::find(m->flags.begin(), m->flags.end(), f) == m->flags.end())
      fail_all("mode " + mode + " does not take the flag '" + f + "'");

  Runtime& rt = Runtime::get();
  // Until the deck says otherwise, its default: a rank stopped before the deck is read ends the job too.
  rt.set_timeout(std::stod(find_key("runtime.timeout")->def));
  Deck deck = rt.load_deck(deck_path, overrides, mode);
  rt.set_timeout(deck.real("runtime.timeout"));
  debug_stop_arm(int(deck.integer("runtime.debug_stop_rank")), long(deck.integer("runtime.debug_stop_step")),
                 deck.str("runtime.debug_stop_phase"));
  check_paths(deck, mode, rt.world());
  if (deck.boolean("run.rank_logs")) Log::get().open_rank_file(deck.str("run.out_dir"));
  if (!m->quiet) {
    const Placement& p = rt.where();
    log_info(version_line());
    log_info("mode " + mode + ": " + std::to_string(p.size) + " rank(s) on " + std::to_string(p.nodes) +
             " node(s); rank 0 on " + p.host);
    log_info("# resolved deck" + (deck_path.empty() ? std::string(" (defaults)") : " from " + deck_path));
    log_info(deck.to_toml(/*hide_secrets=*/true));
  }
  Log::get().rank_info("rank " + std::to_string(rt.where().rank) + " on " + rt.where().host + ", local rank " +
                       std::to_string(rt.where().local_rank) + ", gpu " + std::to_string(rt.where().gpu));
  int rc;
  {
    ScopedTimer timer("mode " + mode);
    rc = m->run(deck, ModeArgs{flags});
  }
  if (!m->quiet && deck.boolean("run.timing")) {
    std::string table = rt.timing_table();
    log_info(table);
  }
  return rc;
}

}  // namespace
}  // namespace q3vl

int main(int argc, char** argv) {
  using namespace q3vl;
  if (argc >= 2 && (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version"))) {
    std::printf("%s\n", version_line().c_str());
    return 0;
  }
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "help")) {
    if (argc >= 3 && !std::strcmp(argv[2], "deck")) {
      std::fputs(deck_help().c_str(), stdout);
      return 0;
    }
    usage(stdout);
    return 0;
  }
  Runtime::init(&argc, &argv);
  int rc = 1;
  try {
    rc = dispatch(argc, argv);
  } catch (const Error& e) {
    if (e.collective()) exit_collective(e.what());
    abort_local(e.what());
  } catch (const std::exception& e) {
    abort_local(e.what());
  }
  Runtime::get().finalize();
  return rc;
}
