#include "strata/offload/collective.h"

#include <algorithm>

namespace strata::offload {
namespace {

const char* KindName(Collective::Kind kind) {
  switch (kind) {
    case Collective::Kind::kAllReduce: return "all-reduce";
    case Collective::Kind::kReduceScatter: return "reduce-scatter";
    case Collective::Kind::kAllGather: return "all-gather";
    case Collective::Kind::kAllToAll: return "all-to-all";
    case Collective::Kind::kAllReduceScalars: return "all-reduce";
  }
  return "collective";
}

}  // namespace

bool Collective::reduces() const {
  return kind != Collective::Kind::kAllGather && kind != Collective::Kind::kAllToAll;
}

size_t Collective::element_bytes() const {
  return kind == Collective::Kind::kAllReduceScalars ? sizeof(double) : DTypeSize(dtype);
}

size_t Collective::send_bytes(int ranks) const {
  const size_t block = count * element_bytes();
  const bool per_rank =
      kind == Collective::Kind::kReduceScatter || kind == Collective::Kind::kAllToAll;
  return per_rank ? block * size_t(ranks) : block;
}

size_t Collective::recv_bytes(int ranks) const {
  const size_t block = count * element_bytes();
  const bool per_rank = kind == Collective::Kind::kAllGather || kind == Collective::Kind::kAllToAll;
  return per_rank ? block * size_t(ranks) : block;
}

size_t Collective::largest_count(int ranks) const {
  return std::max(send_bytes(ranks), recv_bytes(ranks)) / element_bytes();
}

bool Collective::Matches(const Collective& other) const {
  return kind == other.kind && count == other.count &&
         (kind == Collective::Kind::kAllReduceScalars || dtype == other.dtype) &&
         (!reduces() || op == other.op);
}

std::string Collective::Describe() const {
  std::string text = std::string(KindName(kind)) + " of " + std::to_string(count) + " ";
  if (kind == Collective::Kind::kAllReduceScalars) {
    // Step scalars are summed but for the odd max: the op is named only then.
    return text + "step scalars" + (op == ReduceOp::kMax ? " (max)" : "");
  }
  text += DTypeName(dtype);
  if (kind != Collective::Kind::kAllReduce) text += " per rank";
  if (reduces()) text += op == ReduceOp::kSum ? " (sum)" : " (max)";
  return text;
}

}  // namespace strata::offload
