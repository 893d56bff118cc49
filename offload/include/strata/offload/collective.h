// Collective: what one collective is — its kind, element type, operation, count and buffers —
// apart from how a transport runs it, as NCCL keeps a collective's description apart from its
// algorithm and transport. Communicator::Enqueue takes one; every transport reads the same
// fields, so the meaning of `count` and the byte sizes of each kind are said here, once.
#pragma once

#include <cstddef>
#include <string>

#include "strata/core/dtype.h"

namespace strata::offload {

enum class ReduceOp : int {
  kSum = 0,
  kMax = 1,
};

/// One rank's part in one collective. Buffers are the caller's: they stay valid, and unwritten
/// by anyone else, until the collective's done callback has run (see Communicator).
struct Collective {
  enum class Kind : int {
    kAllReduce,         ///< Element-wise `op` over all ranks, in place (send == recv).
    kReduceScatter,     ///< Element-wise `op`; rank r keeps block r of the result.
    kAllGather,         ///< Every rank's block, in rank order, on every rank.
    kAllToAll,          ///< Block r of every rank's send to rank r, in rank order.
    kAllReduceScalars,  ///< A step's scalars (doubles, whatever `dtype` says), in place.
  };

  Kind kind = Kind::kAllReduce;
  DType dtype = DType::kFp32;    ///< Elements' type; ignored by kAllReduceScalars (double).
  ReduceOp op = ReduceOp::kSum;  ///< Ignored by the kinds that only move bits.
  /// Elements of an all-reduce (scalar or not); per rank of a reduce-scatter's output, of an
  /// all-gather's input and of an all-to-all's blocks.
  size_t count = 0;
  const void* send = nullptr;
  void* recv = nullptr;

  static Collective AllReduce(void* data, size_t count, DType dtype, ReduceOp op) {
    return {Kind::kAllReduce, dtype, op, count, data, data};
  }
  static Collective ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                  ReduceOp op) {
    return {Kind::kReduceScatter, dtype, op, recv_count, send, recv};
  }
  static Collective AllGather(const void* send, void* recv, size_t send_count, DType dtype) {
    return {Kind::kAllGather, dtype, ReduceOp::kSum, send_count, send, recv};
  }
  static Collective AllToAll(const void* send, void* recv, size_t count, DType dtype) {
    return {Kind::kAllToAll, dtype, ReduceOp::kSum, count, send, recv};
  }
  static Collective AllReduceScalars(double* values, size_t count, ReduceOp op) {
    return {Kind::kAllReduceScalars, DType::kFp32, op, count, values, values};
  }

  /// Whether `op` applies (all-reduces and reduce-scatters); the others move bits.
  bool reduces() const;
  /// Bytes of one element: the dtype's, or a double's for step scalars.
  size_t element_bytes() const;
  /// Bytes this rank sends and receives in a group of `ranks`.
  size_t send_bytes(int ranks) const;
  size_t recv_bytes(int ranks) const;
  /// Elements of the larger of the two buffers, in a group of `ranks`.
  size_t largest_count(int ranks) const;
  /// Whether `other` is the same collective (kind, count and, where they apply, dtype and op):
  /// what every rank must enqueue at the same position.
  bool Matches(const Collective& other) const;
  /// "all-reduce of 8 fp32 (sum)", "all-gather of 4 bf16 per rank", "all-reduce of 2 step
  /// scalars" (a scalar all-reduce names its op only when it is not a sum): for errors.
  std::string Describe() const;
};

}  // namespace strata::offload
