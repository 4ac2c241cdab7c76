// Where an Exec runs (tensor/dev.hpp), and shapes in messages. (Buffers are raw device pointers carved from arenas:
// the op layer has no tensor class.)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "q3vl/core/dtype.hpp"

namespace q3vl {

enum class Device { CPU, CUDA };

// "[2,3]": a shape in messages.
std::string shape_str(const std::vector<int64_t>& s);

}  // namespace q3vl
