// SIGINT and SIGTERM for a command that ends its work cleanly.
//
// The first signal only sets a flag that the command polls between units of work (a training
// step): it then finishes or abandons what is in flight, removes its scratch files, says what
// it saved last and exits with the shell's code for the signal (128 + its number). A second
// signal ends the process at once, with the signal's default action: what it leaves behind
// (scratch swap, a staging directory) carries its pid, and a later run removes it once that
// pid is gone.
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

/// "SIGINT", "SIGTERM", or "signal N".
const char* SignalName(int signal);

}  // namespace strata::tools
