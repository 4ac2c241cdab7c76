// The tests' checks on refusals: a q3vl::Error whose message names what went wrong (file, key, tensor, value).
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "q3vl/core/error.hpp"

// The message of the q3vl::Error that f throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const q3vl::Error& e) {
    return e.what();
  }
  return "";
}

// f must throw a q3vl::Error whose message contains every one of parts.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << (parts.empty() ? "" : parts[0]) << "'";
  } catch (const q3vl::Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "message: " << e.what()
                                                                                           << "\nmissing: " << p;
  }
}
