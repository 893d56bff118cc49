// SIGINT and SIGTERM for a command that ends its work cleanly.
//
// The first signal only sets a flag that the command polls between units of work (a training
// step): it then finishes what is in flight, removes its scratch files and says what it saved
// last, and the process ends by that same signal (FinishInterrupted), so that the shell sees
// 130 or 143 and a script looping over commands stops at Ctrl-C as it would for any other
// program. A second signal ends the process at once, with the signal's default action: what
// it leaves behind (scratch swap, a staging directory) carries its pid, and a later run removes
// it once that pid is gone. A signal the process inherited as ignored (a background job of a
// non-interactive shell) stays ignored.
#pragma once

namespace strata::tools {

/// Installs the handlers for its lifetime and restores the previous ones after. One at a time.
class InterruptHandlers {
 public:
  InterruptHandlers();
  ~InterruptHandlers();
  InterruptHandlers(const InterruptHandlers&) = delete;
  InterruptHandlers& operator=(const InterruptHandlers&) = delete;

  /// The first signal received (SIGINT or SIGTERM), or 0. Safe from any thread.
  [[nodiscard]] static int received();
};

/// "SIGINT", "SIGTERM", or "a signal".
const char* SignalName(int signal);

/// The exit code of a command that stopped for `signal` once it has cleaned up: 128 + signal.
int InterruptedExitCode(int signal);

/// Called by main with a command's exit code once everything is destroyed: when the command
/// stopped for a signal (InterruptedExitCode), ends the process by that signal; else returns.
void FinishInterrupted(int exit_code);

}  // namespace strata::tools
