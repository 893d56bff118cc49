// The io_uring backend. Owned and driven by the IoEngine's I/O thread, which is the ring's only
// submitter (IORING_SETUP_SINGLE_ISSUER): no locks around the ring.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "strata/nvme/io_backend.h"

namespace strata::nvme {
namespace {

// Sparse table of registered files; a file beyond it is used unregistered.
constexpr unsigned kRegisteredFileSlots = 64;

class UringBackend final : public IoBackend {
 public:
  ~UringBackend() override {
    if (ring_ready_) io_uring_queue_exit(&ring_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  std::string name() const override { return "io_uring"; }

  Status Start(uint32_t queue_depth) override {
    // Newest flags first; older kernels reject what they do not know with EINVAL.
    const unsigned flag_sets[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN,
        IORING_SETUP_COOP_TASKRUN,
        0,
    };
    int result = -EINVAL;
    for (unsigned flags : flag_sets) {
      io_uring_params params{};
      params.flags = flags;
      // One extra entry for the armed wake-up read.
      result = io_uring_queue_init_params(queue_depth + 1, &ring_, &params);
      if (result != -EINVAL) break;
    }
    if (result < 0) return ErrnoError("io_uring_queue_init", -result);
    ring_ready_ = true;
    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) return ErrnoError("eventfd", errno);
    if (io_uring_register_files_sparse(&ring_, kRegisteredFileSlots) == 0) {
      file_slots_.assign(kRegisteredFileSlots, false);
    }
    ArmWake();
    return Status();
  }

  Result<bool> RegisterBuffers(std::span<const iovec> buffers) override {
    const int result =
        io_uring_register_buffers(&ring_, buffers.data(), static_cast<unsigned>(buffers.size()));
    if (result < 0) {
      return ErrnoError("io_uring_register_buffers", -result);
    }
    return true;
  }

  int RegisterFile(int fd) override {
    for (size_t slot = 0; slot < file_slots_.size(); ++slot) {
      if (file_slots_[slot]) continue;
      if (io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1) != 1) {
        return -1;
      }
      file_slots_[slot] = true;
      return static_cast<int>(slot);
    }
    return -1;
  }

  void UnregisterFile(int fixed_index) override {
    int none = -1;
    io_uring_register_files_update(&ring_, static_cast<unsigned>(fixed_index), &none, 1);
    file_slots_[static_cast<size_t>(fixed_index)] = false;
  }

  void Issue(IoPiece* piece) override {
    io_uring_sqe* sqe = GetSqe();
    const int fd = piece->fixed_file >= 0 ? piece->fixed_file : piece->fd;
    const auto length = static_cast<unsigned>(piece->length);
    if (piece->op == IoOp::kRead) {
      if (piece->registered_buffer >= 0) {
        io_uring_prep_read_fixed(sqe, fd, piece->buffer, length, piece->offset,
                                 piece->registered_buffer);
      } else {
        io_uring_prep_read(sqe, fd, piece->buffer, length, piece->offset);
      }
    } else {
      if (piece->registered_buffer >= 0) {
        io_uring_prep_write_fixed(sqe, fd, piece->buffer, length, piece->offset,
                                  piece->registered_buffer);
      } else {
        io_uring_prep_write(sqe, fd, piece->buffer, length, piece->offset);
      }
    }
    if (piece->fixed_file >= 0) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, piece);
  }

  Status SubmitAndWait(const PieceCompletion& complete) override {
    int result;
    do {
      result = io_uring_submit_and_wait(&ring_, 1);
    } while (result == -EINTR);
    if (result < 0 && result != -EAGAIN && result != -EBUSY) {
      return ErrnoError("io_uring_submit_and_wait", -result);
    }
    unsigned head;
    unsigned count = 0;
    io_uring_cqe* cqe;
    bool woken = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++count;
      auto* piece = static_cast<IoPiece*>(io_uring_cqe_get_data(cqe));
      if (piece == nullptr) {
        woken = true;
      } else {
        complete(piece, cqe->res);
      }
    }
    io_uring_cq_advance(&ring_, count);
    if (woken) ArmWake();
    return Status();
  }

  void Wake() override {
    const uint64_t one = 1;
    // A full counter (never in practice) still leaves the fd readable, which is all we need.
    [[maybe_unused]] ssize_t written = write(wake_fd_, &one, sizeof(one));
  }

 private:
  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // SQ full: hand what is queued to the kernel and try again.
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  /// Keeps one read of the wake eventfd in the ring, so Wake() ends a blocked wait.
  void ArmWake() {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_read(sqe, wake_fd_, &wake_value_, sizeof(wake_value_), 0);
    io_uring_sqe_set_data(sqe, nullptr);
  }

  io_uring ring_{};
  bool ring_ready_ = false;
  int wake_fd_ = -1;
  uint64_t wake_value_ = 0;
  std::vector<bool> file_slots_;
};

}  // namespace

Result<std::unique_ptr<IoBackend>> CreateUringBackend() {
  // Probe here, on the caller's thread, so "not usable" is known before the engine starts; the
  // real ring is created by Start() on the I/O thread that will be its single issuer.
  io_uring probe{};
  const int result = io_uring_queue_init(2, &probe, 0);
  if (result < 0) {
    std::string reason = std::string("io_uring_setup: ") + std::strerror(-result);
    if (result == -ENOSYS) reason += " (the kernel has no io_uring)";
    if (result == -EPERM) reason += " (disabled by kernel.io_uring_disabled or seccomp)";
    return Unavailable(reason);
  }
  io_uring_queue_exit(&probe);
  return std::unique_ptr<IoBackend>(new UringBackend());
}

}  // namespace strata::nvme
