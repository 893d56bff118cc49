// Status and Result<T>: the one error type of Strata.
//
// Every fallible function returns a Status (or a Result<T> that holds either a value or a
// non-OK Status). Exceptions are not used for errors. Codes follow the canonical set used by
// Abseil and gRPC; messages say what failed, on what, and what to change.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace strata {

/// Canonical error codes. Keep this list short: a caller branches on the code, a person reads
/// the message.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     ///< The caller asked for something impossible (bad config, bad size).
  kNotFound,            ///< A file, key or device does not exist.
  kAlreadyExists,       ///< Something to create is already there.
  kResourceExhausted,   ///< A budget, pool, disk or memory limit would be exceeded.
  kFailedPrecondition,  ///< The system is not in a state where the call can run.
  kIoError,             ///< An I/O call failed (errno text in the message).
  kDataLoss,            ///< Data read back is not what was written (checksum mismatch).
  kUnavailable,         ///< A feature or device is not present here (no GPU, no io_uring).
  kCancelled,           ///< The operation was cancelled, usually by shutdown.
  kInternal,            ///< A bug in Strata: an invariant did not hold.
};

/// Returns the code's name, e.g. "InvalidArgument".
std::string_view StatusCodeName(StatusCode code);

/// The result of an operation that returns no value. Cheap to copy when OK (no allocation).
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  [[nodiscard]] bool ok() const { return code_ == StatusCode::kOk; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }

  /// "InvalidArgument: message" (or "OK").
  [[nodiscard]] std::string ToString() const;

  /// Returns a copy whose message is prefixed with `context` ("context: message"). Used to add
  /// the outer "what were we doing" while an error travels up.
  Status WithContext(std::string_view context) const;

  /// Marks the status as deliberately ignored (e.g. a best-effort cleanup).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Constructors for each canonical code, so call sites read `return InvalidArgument("...")`.
Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status ResourceExhausted(std::string message);
Status FailedPrecondition(std::string message);
Status IoError(std::string message);
Status DataLoss(std::string message);
Status Unavailable(std::string message);
Status Cancelled(std::string message);
Status Internal(std::string message);

/// Builds an IoError from an errno value: "<what>: <strerror(err)> (errno <err>)".
Status ErrnoError(std::string_view what, int err);

/// Either a value of type T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : data_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : data_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(data_).ok() && "Result built from an OK Status has no value");
  }

  [[nodiscard]] bool ok() const { return std::holds_alternative<T>(data_); }

  /// The error, or an OK status when a value is held.
  [[nodiscard]] const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(data_);
  }

  /// The value. Precondition: ok().
  T& value() & { return std::get<T>(data_); }
  [[nodiscard]] const T& value() const& { return std::get<T>(data_); }
  T&& value() && { return std::get<T>(std::move(data_)); }

  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> data_;
};

namespace internal {
inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
Status AsStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace internal

}  // namespace strata

/// Returns from the enclosing function if `expr` (a Status or Result) is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                                      \
  do {                                                                    \
    ::strata::Status strata_status_ = ::strata::internal::AsStatus(expr); \
    if (!strata_status_.ok()) return strata_status_;                      \
  } while (0)

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

/// `STRATA_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result, or returns its error.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr)                    \
  auto STRATA_CONCAT_(strata_result_, __LINE__) = (expr);     \
  if (!STRATA_CONCAT_(strata_result_, __LINE__).ok())         \
    return STRATA_CONCAT_(strata_result_, __LINE__).status(); \
  lhs = std::move(STRATA_CONCAT_(strata_result_, __LINE__)).value()
