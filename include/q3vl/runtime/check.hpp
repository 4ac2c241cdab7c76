// `q3vl check`: preflight of an allocation. Every rank reports its host, device and resources; rank 0
// prints the table, measures all-reduce bandwidth over all ranks, and the run fails naming the rank and
// host that lacks what the deck asks for.
#pragma once
#include "q3vl/core/deck.hpp"

namespace q3vl {
int run_check(const Deck& deck);
}
