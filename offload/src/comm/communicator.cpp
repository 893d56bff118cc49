#include "strata/offload/communicator.h"

#include <cstring>
#include <future>

#include "comm/collective_peers.h"

namespace strata::offload {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  void AllReduce(void* /*data*/, size_t /*count*/, DType /*dtype*/, ReduceOp /*op*/,
                 CollectiveReady ready, CollectiveDone done) override {
    Run(ready, done, [] {});
  }
  void ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp /*op*/,
                     CollectiveReady ready, CollectiveDone done) override {
    Run(ready, done, [=] { std::memmove(recv, send, recv_count * DTypeSize(dtype)); });
  }
  void AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                 CollectiveReady ready, CollectiveDone done) override {
    Run(ready, done, [=] { std::memmove(recv, send, send_count * DTypeSize(dtype)); });
  }
  void AllToAll(const void* send, void* recv, size_t count, DType dtype, CollectiveReady ready,
                CollectiveDone done) override {
    Run(ready, done, [=] { std::memmove(recv, send, count * DTypeSize(dtype)); });
  }
  void AllReduceScalars(std::span<double> /*values*/, ReduceOp /*op*/, CollectiveReady ready,
                        CollectiveDone done) override {
    Run(ready, done, [] {});
  }

 private:
  /// In place and in order: nothing else is queued.
  template <typename Op>
  static void Run(const CollectiveReady& ready, const CollectiveDone& done, Op op) {
    Status status = ready ? ready() : Status();
    if (status.ok()) op();
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

namespace internal {

std::string PeersOf(int rank, int size) {
  if (size == 2) return "rank " + std::to_string(1 - rank) + ", the other rank,";
  std::string peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
  }
  return "one of ranks " + peers;
}

}  // namespace internal

std::unique_ptr<Communicator> CreateSingleRankCommunicator() {
  return std::make_unique<SingleRankCommunicator>();
}

}  // namespace strata::offload
