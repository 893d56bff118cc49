#include "comm/collective_peers.h"

#include <cstdio>

namespace strata::offload::internal {

std::string PeersOf(int rank, int size) {
  if (size == 2) return "rank " + std::to_string(1 - rank) + ", the other rank,";
  std::string peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
  }
  return "one of ranks " + peers;
}

std::string FormatSeconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

Status DidNotComplete(const std::string& what, double seconds, const std::string& why) {
  return Unavailable(what + " did not complete within " + FormatSeconds(seconds) + ": " + why);
}

std::string PeersStopped(const std::string& peers, const std::string& option) {
  return peers + " died, hangs or stopped enqueueing the same collectives (" + option + ")";
}

}  // namespace strata::offload::internal
