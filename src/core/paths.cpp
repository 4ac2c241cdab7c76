#include "q3vl/core/paths.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace q3vl {

namespace fs = std::filesystem;

namespace {

std::string head(const std::string& key, const std::string& path) { return key + " '" + path + "'"; }

// What the path is now, for messages.
std::string what_is(const fs::path& p) {
  std::error_code ec;
  const fs::file_status s = fs::status(p, ec);
  if (ec || !fs::exists(s)) return "does not exist";
  if (fs::is_directory(s)) return "is a folder";
  if (fs::is_regular_file(s)) return "is a file";
  return "is neither a file nor a folder";
}

}  // namespace

std::string need_file(const std::string& key, const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return "";
  return head(key, path) + " " + what_is(path) + "; it must be a file";
}

std::string need_dir(const std::string& key, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return "";
  return head(key, path) + " " + what_is(path) + "; it must be a folder";
}

std::string need_file_or_dir(const std::string& key, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec) || fs::is_regular_file(path, ec)) return "";
  return head(key, path) + " " + what_is(path);
}

std::string need_writable_dir(const std::string& key, const std::string& path) {
  const std::string h = head(key, path);
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec)) return h + " " + what_is(path) + "; it must be a folder";
  fs::create_directories(path, ec);
  if (ec) return h + ": cannot create the folder: " + ec.message();
  // access(W_OK) says yes to root on a read-only mount: try what the run will do.
  const std::string probe = (fs::path(path) / (".q3vl-write-test-" + std::to_string(getpid()))).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return h + ": cannot write in this folder: " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

std::string need_output_file(const std::string& key, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return head(key, path) + " is a folder; it must be a file to write";
  const fs::path parent = fs::path(path).parent_path();
  return need_writable_dir(key + "'s folder", parent.empty() ? "." : parent.string());
}

std::string shipped_file(const std::string& rel, const std::string& installed) {
  std::error_code ec;
  if (fs::path(rel).is_absolute() || fs::exists(rel, ec)) return rel;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return rel;
  for (const fs::path& p : {exe.parent_path().parent_path() / rel, exe.parent_path().parent_path() / installed})
    if (fs::exists(p, ec)) return p.lexically_normal().string();
  return rel;
}

}  // namespace q3vl
