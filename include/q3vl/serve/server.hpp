// `q3vl serve`: an OpenAI-compatible HTTP server (cpp-httplib) on rank 0 over a continuously batched decode loop.
// HTTP threads parse and check requests (chat template, images decoded and preprocessed) and hand them to the engine
// on the main thread; every engine step mixes chunks of new prompts with one token of each running sequence, over a
// paged KV cache whose size is fixed by serve.kv_mib; a request that does not fit waits in the queue.
#pragma once
#include "q3vl/core/deck.hpp"

namespace q3vl {

int run_serve(const Deck& deck);

}  // namespace q3vl
