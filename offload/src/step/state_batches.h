// Batches of parameter-state reads and writes (Engine::ReadParameterStates,
// WriteParameterStates), grouped the way the engine serves them: one pass per chunk.
#pragma once

#include <xxhash.h>

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
/// and state, in order, and for a write a hash of its values (each rank keeps only its part of
/// what it is given, so ranks given different values would end with a silent mix).
template <typename Item>
std::vector<uint64_t> BatchWords(std::span<const Item> items) {
  std::vector<uint64_t> words;
  words.reserve(3 * items.size());
  for (const Item& item : items) {
    words.insert(words.end(), {item.parameter, uint64_t(item.state)});
    if constexpr (requires { item.values; }) {
      words.push_back(XXH3_64bits(item.values.data(), item.values.size_bytes()));
    }
  }
  return words;
}

}  // namespace strata::offload::internal
