#include "interrupt.h"

#include <signal.h>

#include <atomic>

namespace strata::tools {
namespace {

// Lock-free, so reading and writing it is async-signal-safe.
std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free);

struct sigaction g_previous_int {};
struct sigaction g_previous_term {};

void OnSignal(int signal) {
  int none = 0;
  if (!g_received.compare_exchange_strong(none, signal)) {
    // The second: end now, as the signal would have without a handler.
    ::signal(signal, SIG_DFL);
    ::raise(signal);
  }
}

/// Installs OnSignal for `signal` unless it is ignored; `previous` gets what was there.
void Install(int signal, struct sigaction* previous) {
  sigaction(signal, nullptr, previous);
  if (previous->sa_handler == SIG_IGN) return;
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // The engine's threads' system calls go on undisturbed.
  sigaction(signal, &action, nullptr);
}

}  // namespace

InterruptHandlers::InterruptHandlers() {
  g_received.store(0);
  Install(SIGINT, &g_previous_int);
  Install(SIGTERM, &g_previous_term);
}

InterruptHandlers::~InterruptHandlers() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
}

int InterruptHandlers::received() { return g_received.load(); }

const char* SignalName(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "a signal";
  }
}

int InterruptedExitCode(int signal) { return 128 + signal; }

void FinishInterrupted(int exit_code) {
  const int signal = g_received.load();
  if (signal == 0 || exit_code != InterruptedExitCode(signal)) return;
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

}  // namespace strata::tools
