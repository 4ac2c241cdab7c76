// What a path argument must be, checked before any work is done: a file given as a folder (or the reverse) is
// an error naming the key, not an empty input, and an output that cannot be written is found at start-up, not
// after hours of training. Each check returns "" or the problem, which starts with `key` and the path.
#pragma once
#include <string>

namespace q3vl {

std::string need_file(const std::string& key, const std::string& path);          // an existing regular file
std::string need_dir(const std::string& key, const std::string& path);           // an existing folder
std::string need_file_or_dir(const std::string& key, const std::string& path);   // either
// A folder this process can create files in; made (with its parents) if missing.
std::string need_writable_dir(const std::string& key, const std::string& path);
// A file this process can write: not a folder, and its folder writable (made if missing).
std::string need_output_file(const std::string& key, const std::string& path);

// A data file the repository ships (the tokenizer), named relative to the repository root: as given when it exists
// from the working directory or is absolute; else beside the executable, <exe>/../<rel> (bin/q3vl in a checkout) or
// <exe>/../<installed> (make install: bin/ and share/q3vl/); else unchanged, for the check to name. Job folders are
// rarely the repository root.
std::string shipped_file(const std::string& rel, const std::string& installed);

}  // namespace q3vl
