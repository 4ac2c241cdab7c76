// Errors, in two kinds as in LAMMPS:
//  - collective: every rank reaches the same error together (deck validation, a file every rank reads);
//    the app prints once from rank 0, finalizes MPI and exits 1.
//  - local: one rank hit it (a bad sample, a failed allocation); the app prints with rank and host and
//    calls MPI_Abort so the other ranks do not hang.
// Library code throws; only app/ decides how to end the run. Messages name the file:line (or tensor,
// sample, rank) at fault.
#pragma once
#include <stdexcept>
#include <string>

namespace q3vl {

class Error : public std::runtime_error {
 public:
  enum class Kind { Local, Collective };
  explicit Error(const std::string& msg, Kind kind = Kind::Local) : std::runtime_error(msg), kind_(kind) {}
  Kind kind() const { return kind_; }
  bool collective() const { return kind_ == Kind::Collective; }

 private:
  Kind kind_;
};

// Throw an error that all ranks reach together.
[[noreturn]] inline void fail_all(const std::string& msg) { throw Error(msg, Error::Kind::Collective); }
// Throw an error that this rank alone reached.
[[noreturn]] inline void fail(const std::string& msg) { throw Error(msg, Error::Kind::Local); }

// Check a condition; the message is only built when it fails.
#define Q3VL_CHECK(cond, msg)                                                         \
  do {                                                                                \
    if (!(cond)) ::q3vl::fail(std::string(__FILE__ ":") + std::to_string(__LINE__) + \
                              ": check failed: " #cond ": " + std::string(msg));     \
  } while (0)

}  // namespace q3vl
