// Batches of parameter-state reads and writes (Engine::ReadParameterStates,
// WriteParameterStates), grouped the way the engine serves them: one pass per chunk.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "strata/offload/chunk_layout.h"

namespace strata::offload::internal {

/// The indices of `items` grouped by the chunk of their parameter, chunks in order (checked
/// parameters only).
template <typename Item>
std::map<size_t, std::vector<size_t>> ByChunk(const ChunkLayout& layout,
                                              std::span<const Item> items) {
  std::map<size_t, std::vector<size_t>> by_chunk;
  for (size_t i = 0; i < items.size(); ++i) {
    by_chunk[layout.location(items[i].parameter).chunk].push_back(i);
  }
  return by_chunk;
}

/// What every rank's batch must agree on (Engine::Impl::AgreeOnCall): each entry's parameter
/// and state, in order.
template <typename Item>
std::vector<uint64_t> BatchWords(std::span<const Item> items) {
  std::vector<uint64_t> words;
  words.reserve(2 * items.size());
  for (const Item& item : items) words.insert(words.end(), {item.parameter, uint64_t(item.state)});
  return words;
}

}  // namespace strata::offload::internal
