// ByteLm: the built-in byte-level language model that `strata train` trains.
//
// An "n-gram MLP" language model over bytes, with forward and backward written by hand in fp32:
//
//   h_t   = sum_{j < context} E_j[x_{t-j}]           (bytes before the start of a row read as 0)
//   h     = h + W2 GELU(W1 LayerNorm(h) + b1) + b2   (`layers` residual blocks, hidden 4 * width)
//   logit = Wout LayerNorm(h) + bout                 (final LayerNorm, then the head)
//   loss  = mean over all predicted positions of cross-entropy(softmax(logit_t), x_{t+1})
//
// GELU is the tanh approximation GPT-2 uses, 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))).
// Every LayerNorm has a gain and a bias and eps 1e-5.
//
// The API goes layer by layer because an offload trainer holds only one layer's parameters at a
// time: it fetches them before a call and may release them as soon as the call returns. Layer 0
// is the embedding tables, layers 1..`layers` are the residual blocks and layer `layers` + 1 is
// the final LayerNorm and the head. The model owns the activations it needs for backward, never
// the parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::examples {

/// Size of a ByteLm. Plain values; call Validate() before use.
struct ByteLmConfig {
  int context = 4;  ///< Bytes the model sees at each position (one embedding table each), 1..64.
  int width = 256;  ///< Residual stream width; a multiple of 8. The MLP hidden size is 4 * width.
  int layers = 4;   ///< Residual MLP blocks, 1..1024.

  /// InvalidArgument naming the field and its range when a size is out of range.
  Status Validate() const;
};

/// One parameter tensor of a ByteLm.
struct ParameterInfo {
  std::string name;            ///< E.g. "embed.0", "blocks.3.fc1.weight", "head.bias".
  std::vector<int64_t> shape;  ///< Row-major; weights are [out, in].
  int layer = 0;               ///< The layer whose Forward/Backward use it (0..layers + 1).
};

/// The bytes a ByteLm predicts from: 256 byte values.
inline constexpr int kByteLmVocabulary = 256;

// The free functions below are pure: thread-safe, and they allocate what they return.

/// All parameters in registration order, which is also the order within each layer that
/// Forward/Backward expect: layer 0 holds "embed.0".."embed.{context-1}" ([256, width] each);
/// layer i in 1..layers holds block i-1 ("blocks.{i-1}.ln.gain", ".ln.bias" [width],
/// ".fc1.weight" [4*width, width], ".fc1.bias" [4*width], ".fc2.weight" [width, 4*width],
/// ".fc2.bias" [width]); layer layers+1 holds "final_ln.gain", "final_ln.bias" [width],
/// "head.weight" [256, width] and "head.bias" [256]. Empty when `config` is not valid.
std::vector<ParameterInfo> ByteLmParameters(const ByteLmConfig& config);

/// Number of layers a trainer walks: config.layers + 2 (embeddings, blocks, head).
int ByteLmLayerCount(const ByteLmConfig& config);

/// Fills `out` with the initial value of parameter `index` (in ByteLmParameters order):
/// GPT-2-like, weights and embeddings N(0, 0.02) with "fc2.weight" further scaled by
/// 1/sqrt(2 * layers) (so the residual stream does not grow with depth), biases 0, LayerNorm
/// gains 1. Each parameter draws from its own stream derived from (seed, index), so a trainer can
/// initialize one tensor at a time; the generator (SplitMix64 and Box-Muller) is Strata's own, so
/// the values do not depend on the standard library's distributions.
/// InvalidArgument when the config is invalid, `index` is out of range or `out` has the wrong
/// size.
Status InitByteLmParameter(const ByteLmConfig& config, uint64_t seed, size_t index,
                           std::span<float> out);

/// Every parameter's initial value (InitByteLmParameter for each index), in ByteLmParameters
/// order. Holds the whole model in memory: for small models and tests. Empty when `config` is
/// not valid.
std::vector<std::vector<float>> InitByteLmParameters(const ByteLmConfig& config, uint64_t seed);

/// Forward and backward of a ByteLm, one layer at a time, for one micro-batch at a time.
///
/// A step is: Begin(tokens), Forward(0), ..., Forward(L+1) (which returns the loss), then
/// Backward(L+1), ..., Backward(0), where L = config.layers. Forward alone (no backward) is an
/// evaluation. Forward(0) may be called again at any time after Begin to restart the pass.
///
/// Parameters and gradients are borrowed for the duration of one call only: the model keeps no
/// pointer into them, and their alignment does not change the results (which, for one build,
/// are bit-identical from run to run and between instances). Activations for backward are owned by
/// the model, at peak about batch * seq * (5 * width * layers + 9 * width + 256) floats, and reused
/// across micro-batches. Single-threaded (Eigen's own threading is off). Not thread-safe: one
/// thread drives an instance (distinct instances are independent).
class ByteLm {
 public:
  /// `config` should satisfy Validate(); if not, Begin reports the error.
  explicit ByteLm(ByteLmConfig config);

  ByteLm(const ByteLm&) = delete;
  ByteLm& operator=(const ByteLm&) = delete;
  ByteLm(ByteLm&&) noexcept;
  ByteLm& operator=(ByteLm&&) noexcept;
  ~ByteLm();

  [[nodiscard]] const ByteLmConfig& config() const { return config_; }

  /// Starts a micro-batch. `tokens` holds `batch` rows of `seq` + 1 bytes, row-major: row b
  /// predicts tokens[b][1..seq] from tokens[b][0..seq-1]. The bytes are copied.
  /// InvalidArgument when the config is invalid, batch or seq < 1, or tokens.size() is not
  /// batch * (seq + 1).
  Status Begin(std::span<const uint8_t> tokens, int batch, int seq);

  /// Forward of `layer` with its parameters: one fp32 span per parameter of that layer, in
  /// ByteLmParameters order. Returns the mean cross-entropy (nats per byte) after the last layer,
  /// 0 after the others. InvalidArgument for a layer out of range or spans of the wrong number or
  /// size (naming the parameter); FailedPrecondition when `layer` is not the next one (or 0) or
  /// no micro-batch has begun.
  Result<double> Forward(int layer, std::span<const std::span<const float>> params);

  /// Backward of `layer`; call for layers L+1 down to 0 after the full forward. Overwrites
  /// `grads` (same order and sizes as `params`) with the gradients of the loss times
  /// `loss_scale` (the trainer's fp16 loss scale; 1 otherwise). `params` must be the values the
  /// forward used. Errors as for Forward; also InvalidArgument for a loss_scale that is not
  /// finite and positive, and FailedPrecondition before the forward has finished.
  Status Backward(int layer, std::span<const std::span<const float>> params,
                  std::span<const std::span<float>> grads, float loss_scale = 1.0f);

 private:
  struct State;
  ByteLmConfig config_;
  std::unique_ptr<State> state_;
};

}  // namespace strata::examples
