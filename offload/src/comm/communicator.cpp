#include "strata/offload/communicator.h"

#include <cstring>
#include <future>

namespace strata::offload {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  /// In place and in order: nothing else is queued. With one rank every collective's output
  /// is its input (an all-reduce's and step scalars' already are).
  void Enqueue(const Collective& collective, CollectiveReady ready, CollectiveDone done) override {
    Status status = ready ? ready() : Status();
    if (status.ok() && collective.send != collective.recv) {
      std::memmove(collective.recv, collective.send, collective.recv_bytes(1));
    }
    if (done) done(std::move(status));
  }
};

}  // namespace

Status Communicator::AllReduceNow(std::span<double> values, ReduceOp op) {
  std::promise<Status> finished;
  std::future<Status> result = finished.get_future();
  AllReduceScalars(values, op, {},
                   [&finished](Status status) { finished.set_value(std::move(status)); });
  return result.get();
}

Status Communicator::AllGatherBlocking(const void* send, void* recv, size_t send_count,
                                       size_t recv_count, DType dtype) {
  if (recv_count != send_count * size_t(size())) {
    return InvalidArgument("AllGatherNow of " + std::to_string(send_count) + " elements across " +
                           std::to_string(size()) + " ranks needs room for " +
                           std::to_string(send_count * size_t(size())) + ", not " +
                           std::to_string(recv_count));
  }
  std::promise<Status> finished;
  std::future<Status> result = finished.get_future();
  AllGather(send, recv, send_count, dtype, {},
            [&finished](Status status) { finished.set_value(std::move(status)); });
  return result.get();
}

Status Communicator::AllGatherNow(std::span<const uint64_t> send, std::span<uint64_t> recv) {
  // A gather only moves elements: two fp32 "elements" per word carry its bits unchanged.
  static_assert(sizeof(uint64_t) == 2 * sizeof(float));
  return AllGatherBlocking(send.data(), recv.data(), 2 * send.size(), 2 * recv.size(),
                           DType::kFp32);
}

Status Communicator::AllGatherNow(std::span<const float> send, std::span<float> recv) {
  return AllGatherBlocking(send.data(), recv.data(), send.size(), recv.size(), DType::kFp32);
}

std::unique_ptr<Communicator> CreateSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace strata::offload
