#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"

using namespace q3vl;

namespace {

// Parse deck text and return the error message ("" if it parsed).
std::string deck_error(const std::string& text, std::vector<std::string> overrides = {}, const std::string& mode = "check") {
  try {
    Deck::parse(text, "deck.toml", overrides, mode);
  } catch (const Error& e) {
    EXPECT_TRUE(e.collective()) << "deck errors are reached by all ranks together";
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Deck, DefaultsAndValues) {
  Deck d = Deck::parse("[train]\nlr = 3e-4\nsteps = 7\n[run]\nname = \"x y\"\n", "deck.toml", {}, "check");
  EXPECT_DOUBLE_EQ(d.real("train.lr"), 3e-4);
  EXPECT_EQ(d.integer("train.steps"), 7);
  EXPECT_EQ(d.str("run.name"), "x y");
  EXPECT_EQ(d.integer("parallel.zero_stage"), 3);  // default
  EXPECT_TRUE(d.given("train.lr"));
  EXPECT_FALSE(d.given("parallel.zero_stage"));
}

TEST(Deck, IntegerAcceptedForReal) {
  Deck d = Deck::parse("[train]\nlr = 1\n", "deck.toml", {}, "check");
  EXPECT_DOUBLE_EQ(d.real("train.lr"), 1.0);
}

TEST(Deck, UnknownKeyNamesLineColumnAndClosest) {
  std::string m = deck_error("[train]\nsteps = 3\n  lrr = 1e-4\n");
  EXPECT_NE(m.find("deck.toml:3:3"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown key 'train.lrr'"), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean 'train.lr'"), std::string::npos) << m;
}

TEST(Deck, MisspelledSection) {
  std::string m = deck_error("[run]\nseed = 1\n[trian]\nlr = 1e-4\n");
  EXPECT_NE(m.find("deck.toml:3:1"), std::string::npos) << m;
  EXPECT_NE(m.find("unknown section [trian]"), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean [train]"), std::string::npos) << m;
}

TEST(Deck, WrongType) {
  std::string m = deck_error("[train]\nlr = \"fast\"\n");
  EXPECT_NE(m.find("deck.toml:2:6"), std::string::npos) << m;
  EXPECT_NE(m.find("train.lr expects a number"), std::string::npos) << m;
  m = deck_error("[train]\nsteps = 2.5\n");
  EXPECT_NE(m.find("train.steps expects an integer"), std::string::npos) << m;
}

TEST(Deck, OutOfRange) {
  std::string m = deck_error("[parallel]\nzero_stage = 5\n");
  EXPECT_NE(m.find("deck.toml:2:14"), std::string::npos) << m;
  EXPECT_NE(m.find("parallel.zero_stage = 5 is out of range [1, 3]"), std::string::npos) << m;
  m = deck_error("[model]\nbackend = \"tpu\"\n");
  EXPECT_NE(m.find("model.backend = \"tpu\" is not one of \"cpu\", \"cuda\""), std::string::npos) << m;
}

TEST(Deck, MissingRequiredKeyForMode) {
  std::string m = deck_error("[eval]\noutput = \"o.h5\"\n", {}, "eval");
  EXPECT_NE(m.find("missing required key 'eval.batch' for mode eval"), std::string::npos) << m;
  EXPECT_EQ(deck_error("[eval]\noutput = \"o.h5\"\n", {"eval.batch=b.h5"}, "eval"), "");
  EXPECT_EQ(deck_error("", {}, "check"), "");  // not required in other modes
}

TEST(Deck, SyntaxError) {
  std::string m = deck_error("[train]\nlr = 1e-4\nsteps = \n");
  EXPECT_NE(m.find("deck.toml:3:"), std::string::npos) << m;
  EXPECT_NE(m.find("syntax error"), std::string::npos) << m;
}

TEST(Deck, TopLevelKeyIsAnError) {
  std::string m = deck_error("lr = 1\n");
  EXPECT_NE(m.find("deck.toml:1:"), std::string::npos) << m;
  EXPECT_NE(m.find("must be a [section]"), std::string::npos) << m;
}

TEST(Deck, CommandLineOverrides) {
  Deck d = Deck::parse("[train]\nlr = 1e-4\n", "deck.toml", {"train.lr=2e-3", "run.name=abc", "run.rank_logs=true"}, "check");
  EXPECT_DOUBLE_EQ(d.real("train.lr"), 2e-3);
  EXPECT_EQ(d.str("run.name"), "abc");
  EXPECT_TRUE(d.boolean("run.rank_logs"));

  std::string m = deck_error("", {"train.lr=abc"});
  EXPECT_NE(m.find("command line: 'train.lr=abc': train.lr expects a number"), std::string::npos) << m;
  m = deck_error("", {"trian.lr=1"});
  EXPECT_NE(m.find("unknown key 'trian.lr' (did you mean 'train.lr'?)"), std::string::npos) << m;
  m = deck_error("", {"parallel.zero_stage=0"});
  EXPECT_NE(m.find("out of range"), std::string::npos) << m;
  m = deck_error("", {"train.lr"});
  EXPECT_NE(m.find("not of the form section.key=value"), std::string::npos) << m;
  m = deck_error("", {"run.rank_logs=yes"});
  EXPECT_NE(m.find("expects a boolean"), std::string::npos) << m;
  m = deck_error("", {"=3"});  // not a misspelling of any key
  EXPECT_NE(m.find("command line: '=3': the override lacks a key"), std::string::npos) << m;
  EXPECT_EQ(m.find("did you mean"), std::string::npos) << m;
}

TEST(Deck, ResolvedTextRoundTrips) {
  Deck d = Deck::parse("[train]\nlr = 0.1\n[run]\nname = \"quote\\\" and \\\\ back\"\n", "deck.toml",
                       {"runtime.timeout=1.5"}, "check");
  Deck e = Deck::parse(d.to_toml(), "resolved", {}, "check");
  EXPECT_EQ(d.to_toml(), e.to_toml());
  EXPECT_DOUBLE_EQ(e.real("train.lr"), 0.1);
  EXPECT_EQ(e.str("run.name"), "quote\" and \\ back");
  EXPECT_DOUBLE_EQ(e.real("runtime.timeout"), 1.5);
}

TEST(Deck, HelpListsEveryKey) {
  std::string h = deck_help();
  for (const auto& k : deck_schema()) {
    std::string key = k.name.substr(k.name.find('.') + 1);
    EXPECT_NE(h.find("  " + key + " ("), std::string::npos) << k.name;
    EXPECT_NE(h.find(k.help), std::string::npos) << k.name;
  }
}

TEST(Deck, MissingFile) {
  try {
    Deck::load("/nonexistent/deck.toml", {}, "check");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open deck '/nonexistent/deck.toml'"), std::string::npos);
  }
}

TEST(Deck, FolderIsNotADeck) {
  // An ifstream opens a folder and reads nothing: that must not run on the defaults.
  try {
    Deck::load("/tmp", {}, "check");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(e.collective());
    EXPECT_NE(std::string(e.what()).find("deck '/tmp' is a folder; it must be a TOML file"), std::string::npos) << e.what();
  }
}
