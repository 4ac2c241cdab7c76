// Path arguments are checked for what they must be before any work: a folder where a file is expected (and the
// reverse) and an output that cannot be written are errors naming the key and the path.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "q3vl/core/paths.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {
struct Tmp {
  std::string dir = (fs::temp_directory_path() / ("q3vl_test_paths_" + std::to_string(getpid()))).string();
  Tmp() {
    fs::create_directories(dir);
    std::ofstream(dir + "/file") << "x";
  }
  ~Tmp() { fs::remove_all(dir); }
};
}  // namespace

TEST(Paths, FileOrFolder) {
  Tmp t;
  EXPECT_EQ(need_file("k", t.dir + "/file"), "");
  EXPECT_EQ(need_file("prepare.input", t.dir), "prepare.input '" + t.dir + "' is a folder; it must be a file");
  EXPECT_EQ(need_file("k", t.dir + "/none"), "k '" + t.dir + "/none' does not exist; it must be a file");
  EXPECT_EQ(need_dir("k", t.dir), "");
  EXPECT_EQ(need_dir("model.hf", t.dir + "/file"), "model.hf '" + t.dir + "/file' is a file; it must be a folder");
  EXPECT_EQ(need_file_or_dir("k", t.dir), "");
  EXPECT_EQ(need_file_or_dir("k", t.dir + "/file"), "");
  EXPECT_EQ(need_file_or_dir("k", t.dir + "/none"), "k '" + t.dir + "/none' does not exist");
}

TEST(Paths, WritableFolderIsMadeAndTried) {
  Tmp t;
  EXPECT_EQ(need_writable_dir("checkpoint.dir", t.dir + "/a/b"), "");
  EXPECT_TRUE(fs::is_directory(t.dir + "/a/b"));
  EXPECT_TRUE(fs::is_empty(t.dir + "/a/b"));  // the probe file is gone
  const std::string e = need_writable_dir("checkpoint.dir", t.dir + "/file/ck");
  EXPECT_EQ(e.rfind("checkpoint.dir '" + t.dir + "/file/ck': cannot create the folder", 0), 0u) << e;
  EXPECT_EQ(need_writable_dir("run.out_dir", t.dir + "/file"),
            "run.out_dir '" + t.dir + "/file' is a file; it must be a folder");
}

TEST(Paths, OutputFile) {
  Tmp t;
  EXPECT_EQ(need_output_file("generate.output", t.dir + "/new/answers.jsonl"), "");
  EXPECT_TRUE(fs::is_directory(t.dir + "/new"));
  EXPECT_EQ(need_output_file("generate.output", t.dir), "generate.output '" + t.dir + "' is a folder; it must be a file to write");
  EXPECT_EQ(need_output_file("generate.output", "answers.jsonl"), "");  // the current folder
  const std::string e = need_output_file("eval.output", t.dir + "/file/out.h5");
  EXPECT_EQ(e.rfind("eval.output's folder '" + t.dir + "/file'", 0), 0u) << e;
}
