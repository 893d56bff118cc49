// ByteLm: forward and backward by hand, with Eigen for the matrix products.
//
// Every tensor is row-major, one row per position (N = batch * seq rows). Weights are [out, in],
// so a linear layer is Y = X W^T + b. Activations kept for backward, per block: the normalized
// LayerNorm input (xhat), its 1/std per row and the GELU input; the LayerNorm output and the GELU
// output are recomputed in backward from these, which costs little next to the products and
// saves 5 * width floats per row and block.

#include "strata/examples/byte_lm.h"

// One thread drives a ByteLm (the trainer runs its I/O on threads of its own), so Eigen must not
// start an OpenMP team even if the build adds -fopenmp.
#define EIGEN_DONT_PARALLELIZE
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <new>
#include <string>
#include <string_view>

namespace strata::examples {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using RowVectorMap = Eigen::Map<Eigen::RowVectorXf>;
using ConstRowVectorMap = Eigen::Map<const Eigen::RowVectorXf>;
using ColumnMap = Eigen::Map<Eigen::VectorXf>;
using ConstColumnMap = Eigen::Map<const Eigen::VectorXf>;
using ArrayMap = Eigen::Map<Eigen::ArrayXf>;
using ConstArrayMap = Eigen::Map<const Eigen::ArrayXf>;

constexpr float kLayerNormEps = 1e-5f;
constexpr float kInitStd = 0.02f;
constexpr int kMaxContext = 64;
constexpr int kMaxWidth = 1 << 16;
constexpr int kMaxLayers = 1024;
constexpr int64_t kVocab = kByteLmVocabulary;

// GELU, tanh approximation: 0.5 u (1 + tanh(kGeluScale (u + kGeluCubic u^3))).
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
// GELU runs over slices this long so its temporaries stay in L1/L2 instead of spanning the
// whole N x 4 * width activation.
constexpr Eigen::Index kGeluSlice = 4096;

// Allocates activations on 64-byte boundaries. Eigen splits a vectorized reduction into a
// scalar head and packets where the data becomes aligned, so the bits of a sum depend on the
// buffer's address; fixing the alignment makes two instances (or two runs) agree exactly.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheLineAllocator() = default;
  template <typename U>
  explicit CacheLineAllocator(const CacheLineAllocator<U>& /*other*/) {}

  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t /*n*/) { ::operator delete(p, kAlignment); }

  friend bool operator==(const CacheLineAllocator&, const CacheLineAllocator&) { return true; }
};

using Activations = std::vector<float, CacheLineAllocator<float>>;

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Writes gelu(u) into `out`.
void Gelu(const float* u, float* out, Eigen::Index n) {
  for (Eigen::Index begin = 0; begin < n; begin += kGeluSlice) {
    const Eigen::Index len = std::min(kGeluSlice, n - begin);
    ConstArrayMap x(u + begin, len);
    ArrayMap y(out + begin, len);
    y = 0.5f * x * (1.0f + (kGeluScale * (x + kGeluCubic * x.cube())).tanh());
  }
}

// Multiplies `grad` (dL/dgelu(u)) in place by gelu'(u), turning it into dL/du.
void GeluBackward(const float* u, float* grad, Eigen::Index n) {
  Eigen::ArrayXf t(std::min(kGeluSlice, n));
  for (Eigen::Index begin = 0; begin < n; begin += kGeluSlice) {
    const Eigen::Index len = std::min(kGeluSlice, n - begin);
    ConstArrayMap x(u + begin, len);
    ArrayMap g(grad + begin, len);
    auto tanh = t.head(len);
    tanh = (kGeluScale * (x + kGeluCubic * x.cube())).tanh();
    g *= 0.5f * (1.0f + tanh) +
         0.5f * x * (1.0f - tanh.square()) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x.square());
  }
}

// Writes the sum of the rows of `m` into `out`, adding one row at a time so that every element
// is summed in row order. Eigen's colwise().sum() would choose its order from the address of
// `out`, which is the caller's gradient buffer; the bits must not depend on it.
void SumRows(const MatrixMap& m, RowVectorMap& out) {
  out.setZero();
  for (Eigen::Index row = 0; row < m.rows(); ++row) out += m.row(row);
}

// y = LayerNorm(x) * gain + bias, keeping xhat = (x - mean) / std and 1/std for backward.
void LayerNormForward(const ConstMatrixMap& x, const ConstRowVectorMap& gain,
                      const ConstRowVectorMap& bias, MatrixMap& xhat, ColumnMap& inv_std,
                      MatrixMap& y) {
  const Eigen::VectorXf mean = x.rowwise().mean();
  xhat = x.colwise() - mean;
  // Two passes (mean, then centered squares) rather than E[x^2] - E[x]^2, which cancels badly
  // when the residual stream has a large mean.
  inv_std = ((xhat.array().square().rowwise().mean() + kLayerNormEps).sqrt().inverse()).matrix();
  xhat.array().colwise() *= inv_std.array();
  y = (xhat.array().rowwise() * gain.array()).rowwise() + bias.array();
}

// y = xhat * gain + bias (the LayerNorm output, recomputed in backward).
void LayerNormOutput(const ConstMatrixMap& xhat, const ConstRowVectorMap& gain,
                     const ConstRowVectorMap& bias, MatrixMap& y) {
  y = (xhat.array().rowwise() * gain.array()).rowwise() + bias.array();
}

// Given dy = dL/dy, writes the gain and bias gradients and dx = dL/dx (added to `dx` when
// `accumulate`, which is how the residual branch joins the skip connection). The gain and bias
// gradients are summed row by row, as in SumRows.
void LayerNormBackward(const RowMatrix& dy, const ConstMatrixMap& xhat,
                       const ConstColumnMap& inv_std, const ConstRowVectorMap& gain,
                       RowVectorMap& dgain, RowVectorMap& dbias, MatrixMap& dx, bool accumulate) {
  dgain.setZero();
  dbias.setZero();
  for (Eigen::Index row = 0; row < dy.rows(); ++row) {
    dgain.array() += dy.row(row).array() * xhat.row(row).array();
    dbias += dy.row(row);
  }
  const RowMatrix dxhat = (dy.array().rowwise() * gain.array()).matrix();
  const Eigen::VectorXf mean_dxhat = dxhat.rowwise().mean();
  const Eigen::VectorXf mean_dxhat_xhat = (dxhat.array() * xhat.array()).rowwise().mean();
  // dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std, per row.
  auto branch =
      (((dxhat.colwise() - mean_dxhat).array() - xhat.array().colwise() * mean_dxhat_xhat.array())
           .colwise() *
       inv_std.array())
          .matrix();
  if (accumulate) {
    dx += branch;
  } else {
    dx = branch;
  }
}

// Deterministic normal numbers from SplitMix64 and Box-Muller, so initial values do not depend
// on the standard library's (implementation-defined) distributions.
class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) : state_(seed) {}

  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - Uniform();  // (0, 1]: log(u1) is finite.
    const double u2 = Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 6.283185307179586 * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  uint64_t NextBits() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return double(NextBits() >> 11) * 0x1.0p-53; }  // [0, 1)

  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace

Status ByteLmConfig::Validate() const {
  if (context < 1 || context > kMaxContext) {
    return InvalidArgument("byte_lm context " + std::to_string(context) +
                           " is out of range; use 1.." + std::to_string(kMaxContext));
  }
  if (width < 8 || width > kMaxWidth || width % 8 != 0) {
    return InvalidArgument("byte_lm width " + std::to_string(width) +
                           " is invalid; use a multiple of 8 in 8.." + std::to_string(kMaxWidth));
  }
  if (layers < 1 || layers > kMaxLayers) {
    return InvalidArgument("byte_lm layers " + std::to_string(layers) +
                           " is out of range; use 1.." + std::to_string(kMaxLayers));
  }
  return Status::Ok();
}

std::vector<ParameterInfo> ByteLmParameters(const ByteLmConfig& config) {
  std::vector<ParameterInfo> params;
  if (!config.Validate().ok()) return params;
  const int64_t d = config.width;
  for (int j = 0; j < config.context; ++j) {
    params.push_back({"embed." + std::to_string(j), {kVocab, d}, 0});
  }
  for (int b = 0; b < config.layers; ++b) {
    const std::string prefix = "blocks." + std::to_string(b) + ".";
    const int layer = b + 1;
    params.push_back({prefix + "ln.gain", {d}, layer});
    params.push_back({prefix + "ln.bias", {d}, layer});
    params.push_back({prefix + "fc1.weight", {4 * d, d}, layer});
    params.push_back({prefix + "fc1.bias", {4 * d}, layer});
    params.push_back({prefix + "fc2.weight", {d, 4 * d}, layer});
    params.push_back({prefix + "fc2.bias", {d}, layer});
  }
  const int head_layer = config.layers + 1;
  params.push_back({"final_ln.gain", {d}, head_layer});
  params.push_back({"final_ln.bias", {d}, head_layer});
  params.push_back({"head.weight", {kVocab, d}, head_layer});
  params.push_back({"head.bias", {kVocab}, head_layer});
  return params;
}

int ByteLmLayerCount(const ByteLmConfig& config) { return config.layers + 2; }

namespace {

// Fills `out` (already checked to have the right size) with parameter `index`'s initial value.
void InitParameter(const ByteLmConfig& config, const ParameterInfo& info, uint64_t seed,
                   size_t index, std::span<float> out) {
  auto ends_with = [&](std::string_view suffix) {
    return info.name.size() >= suffix.size() &&
           info.name.compare(info.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with(".gain")) {
    std::fill(out.begin(), out.end(), 1.0f);
  } else if (ends_with(".bias")) {
    std::fill(out.begin(), out.end(), 0.0f);
  } else {
    // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2 * depth);
    // here that is fc2 only (one residual write per block).
    double std = kInitStd;
    if (ends_with("fc2.weight")) std /= std::sqrt(2.0 * config.layers);
    NormalStream normal(seed ^ (0xD1B54A32D192ED03ull * (uint64_t(index) + 1)));
    for (float& value : out) value = float(std * normal.Next());
  }
}

}  // namespace

Status InitByteLmParameter(const ByteLmConfig& config, uint64_t seed, size_t index,
                           std::span<float> out) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  const std::vector<ParameterInfo> params = ByteLmParameters(config);
  if (index >= params.size()) {
    return InvalidArgument("byte_lm has " + std::to_string(params.size()) + " parameters; index " +
                           std::to_string(index) + " is out of range");
  }
  const ParameterInfo& info = params[index];
  if (int64_t(out.size()) != Elements(info.shape)) {
    return InvalidArgument("byte_lm parameter " + info.name + " " + ShapeText(info.shape) +
                           " has " + std::to_string(Elements(info.shape)) +
                           " elements; the output span has " + std::to_string(out.size()));
  }
  InitParameter(config, info, seed, index, out);
  return Status::Ok();
}

std::vector<std::vector<float>> InitByteLmParameters(const ByteLmConfig& config, uint64_t seed) {
  // Lists the parameters once (InitByteLmParameter would list them for every tensor).
  const std::vector<ParameterInfo> params = ByteLmParameters(config);
  std::vector<std::vector<float>> values;
  values.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    values.emplace_back(size_t(Elements(params[i].shape)));
    InitParameter(config, params[i], seed, i, values.back());
  }
  return values;
}

/// Everything a ByteLm keeps between calls.
struct ByteLm::State {
  struct BlockActivations {
    Activations xhat;      // N x D, normalized LayerNorm input.
    Activations inv_std;   // N, 1/std of the LayerNorm input rows.
    Activations pre_gelu;  // N x 4D, fc1 output.
  };

  std::vector<ParameterInfo> params;
  std::vector<size_t> layer_first;  // layer_first[l]..layer_first[l+1] are layer l's parameters.

  std::vector<uint8_t> tokens;  // batch x (seq + 1).
  int batch = 0;
  int seq = 0;
  bool begun = false;
  int next_forward = 0;    // Forward accepts this layer (or 0, which restarts).
  int next_backward = -1;  // Backward accepts this layer; -1: no backward pending.

  Activations hidden;  // N x D residual stream, then its gradient in backward.
  std::vector<BlockActivations> blocks;
  Activations final_xhat;     // N x D.
  Activations final_inv_std;  // N.
  Activations probs;          // N x 256 softmax, then dL/dlogits in backward.
  // Scratch, reused by every layer.
  Activations ln_out;  // N x D.
  Activations gelu;    // N x 4D, GELU output; dL/du in backward.

  [[nodiscard]] Eigen::Index rows() const { return Eigen::Index(batch) * seq; }

  // The byte at offset `j` before position `row` of the flattened batch (0 before the start).
  [[nodiscard]] int Input(Eigen::Index row, int j) const {
    const int64_t b = row / seq;
    const int64_t p = row % seq;
    return p >= j ? tokens[size_t(b * (seq + 1) + p - j)] : 0;
  }
  [[nodiscard]] int Target(Eigen::Index row) const {
    const int64_t b = row / seq;
    const int64_t p = row % seq;
    return tokens[size_t(b * (seq + 1) + p + 1)];
  }
};

ByteLm::ByteLm(ByteLmConfig config) : config_(config), state_(std::make_unique<State>()) {
  state_->params = ByteLmParameters(config_);
  if (state_->params.empty()) return;  // Invalid config: Begin reports it.
  const int layer_count = ByteLmLayerCount(config_);
  state_->layer_first.assign(size_t(layer_count) + 1, state_->params.size());
  for (size_t i = state_->params.size(); i-- > 0;) {
    state_->layer_first[size_t(state_->params[i].layer)] = i;
  }
  state_->blocks.resize(size_t(config_.layers));
}

ByteLm::ByteLm(ByteLm&&) noexcept = default;
ByteLm& ByteLm::operator=(ByteLm&&) noexcept = default;
ByteLm::~ByteLm() = default;

Status ByteLm::Begin(std::span<const uint8_t> tokens, int batch, int seq) {
  STRATA_RETURN_IF_ERROR(config_.Validate());
  if (batch < 1 || seq < 1) {
    return InvalidArgument("byte_lm micro-batch of " + std::to_string(batch) + " rows of " +
                           std::to_string(seq) + " positions; both must be at least 1");
  }
  const int64_t expected = int64_t(batch) * (int64_t(seq) + 1);
  if (int64_t(tokens.size()) != expected) {
    return InvalidArgument(
        "byte_lm micro-batch of " + std::to_string(batch) + " rows of " + std::to_string(seq) +
        " positions needs batch * (seq + 1) = " + std::to_string(expected) +
        " token bytes (inputs and the next byte), got " + std::to_string(tokens.size()));
  }
  State& s = *state_;
  s.tokens.assign(tokens.begin(), tokens.end());
  s.batch = batch;
  s.seq = seq;
  s.begun = true;
  s.next_forward = 0;
  s.next_backward = -1;

  const auto n = size_t(s.rows());
  const auto d = size_t(config_.width);
  s.hidden.resize(n * d);
  for (State::BlockActivations& block : s.blocks) {
    block.xhat.resize(n * d);
    block.inv_std.resize(n);
    block.pre_gelu.resize(n * 4 * d);
  }
  s.final_xhat.resize(n * d);
  s.final_inv_std.resize(n);
  s.probs.resize(n * size_t(kVocab));
  s.ln_out.resize(n * d);
  s.gelu.resize(n * 4 * d);
  return Status::Ok();
}

namespace {

// Checks that `spans` are the parameters (or gradients) of `layer`: one per parameter, each of
// the parameter's size.
template <typename Span>
Status CheckLayerSpans(const std::vector<ParameterInfo>& params, size_t first, size_t last,
                       int layer, std::span<const Span> spans, const char* what) {
  const size_t expected = last - first;
  if (spans.size() != expected) {
    return InvalidArgument("byte_lm layer " + std::to_string(layer) + " takes " +
                           std::to_string(expected) + " " + what + " spans (" + params[first].name +
                           " .. " + params[last - 1].name + "), got " +
                           std::to_string(spans.size()));
  }
  for (size_t i = 0; i < expected; ++i) {
    const ParameterInfo& info = params[first + i];
    if (int64_t(spans[i].size()) != Elements(info.shape)) {
      return InvalidArgument("byte_lm " + std::string(what) + " span for " + info.name + " " +
                             ShapeText(info.shape) + " has " + std::to_string(spans[i].size()) +
                             " floats; expected " + std::to_string(Elements(info.shape)));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<double> ByteLm::Forward(int layer, std::span<const std::span<const float>> params) {
  State& s = *state_;
  const int last_layer = config_.layers + 1;
  if (layer < 0 || layer > last_layer) {
    return InvalidArgument("byte_lm Forward layer " + std::to_string(layer) +
                           " is out of range; layers are 0.." + std::to_string(last_layer));
  }
  if (!s.begun) {
    return FailedPrecondition("byte_lm Forward before Begin: start a micro-batch first");
  }
  if (layer != 0 && layer != s.next_forward) {
    return FailedPrecondition("byte_lm Forward of layer " + std::to_string(layer) +
                              " out of order: the next layer is " + std::to_string(s.next_forward) +
                              " (forward runs layers 0.." + std::to_string(last_layer) +
                              " in order)");
  }
  const size_t first = s.layer_first[size_t(layer)];
  const size_t last = s.layer_first[size_t(layer) + 1];
  STRATA_RETURN_IF_ERROR(CheckLayerSpans(s.params, first, last, layer, params, "parameter"));

  const Eigen::Index n = s.rows();
  const Eigen::Index d = config_.width;
  MatrixMap hidden(s.hidden.data(), n, d);
  double loss = 0.0;

  if (layer == 0) {
    hidden.setZero();
    for (int j = 0; j < config_.context; ++j) {
      ConstMatrixMap table(params[size_t(j)].data(), kVocab, d);
      for (Eigen::Index row = 0; row < n; ++row) hidden.row(row) += table.row(s.Input(row, j));
    }
  } else if (layer <= config_.layers) {
    State::BlockActivations& block = s.blocks[size_t(layer - 1)];
    ConstRowVectorMap gain(params[0].data(), d);
    ConstRowVectorMap bias(params[1].data(), d);
    ConstMatrixMap fc1_weight(params[2].data(), 4 * d, d);
    ConstRowVectorMap fc1_bias(params[3].data(), 4 * d);
    ConstMatrixMap fc2_weight(params[4].data(), d, 4 * d);
    ConstRowVectorMap fc2_bias(params[5].data(), d);
    MatrixMap xhat(block.xhat.data(), n, d);
    ColumnMap inv_std(block.inv_std.data(), n);
    MatrixMap ln_out(s.ln_out.data(), n, d);
    MatrixMap pre_gelu(block.pre_gelu.data(), n, 4 * d);
    MatrixMap gelu(s.gelu.data(), n, 4 * d);

    LayerNormForward(ConstMatrixMap(s.hidden.data(), n, d), gain, bias, xhat, inv_std, ln_out);
    pre_gelu.noalias() = ln_out * fc1_weight.transpose();
    pre_gelu.rowwise() += fc1_bias;
    Gelu(block.pre_gelu.data(), s.gelu.data(), n * 4 * d);
    hidden.noalias() += gelu * fc2_weight.transpose();
    hidden.rowwise() += fc2_bias;
  } else {
    ConstRowVectorMap gain(params[0].data(), d);
    ConstRowVectorMap bias(params[1].data(), d);
    ConstMatrixMap head_weight(params[2].data(), kVocab, d);
    ConstRowVectorMap head_bias(params[3].data(), kVocab);
    MatrixMap xhat(s.final_xhat.data(), n, d);
    ColumnMap inv_std(s.final_inv_std.data(), n);
    MatrixMap ln_out(s.ln_out.data(), n, d);
    MatrixMap logits(s.probs.data(), n, kVocab);

    LayerNormForward(ConstMatrixMap(s.hidden.data(), n, d), gain, bias, xhat, inv_std, ln_out);
    logits.noalias() = ln_out * head_weight.transpose();
    logits.rowwise() += head_bias;
    // Softmax in place, and the loss -log p[target] = log(sum exp(l - max)) + max - l[target],
    // summed in double so the mean over many rows keeps fp32 precision.
    double loss_sum = 0.0;
    for (Eigen::Index row = 0; row < n; ++row) {
      auto r = logits.row(row);
      const float max = r.maxCoeff();
      const float target_logit = r(s.Target(row));
      r.array() = (r.array() - max).exp();
      const double sum = r.cast<double>().sum();
      r *= float(1.0 / sum);
      loss_sum += std::log(sum) + double(max) - double(target_logit);
    }
    loss = loss_sum / double(n);
  }

  s.next_forward = layer + 1;
  s.next_backward = layer == last_layer ? last_layer : -1;
  return loss;
}

Status ByteLm::Backward(int layer, std::span<const std::span<const float>> params,
                        std::span<const std::span<float>> grads, float loss_scale) {
  State& s = *state_;
  const int last_layer = config_.layers + 1;
  if (layer < 0 || layer > last_layer) {
    return InvalidArgument("byte_lm Backward layer " + std::to_string(layer) +
                           " is out of range; layers are 0.." + std::to_string(last_layer));
  }
  if (!std::isfinite(loss_scale) || loss_scale <= 0.0f) {
    return InvalidArgument("byte_lm loss_scale " + std::to_string(loss_scale) +
                           " must be finite and positive (1 when not scaling)");
  }
  if (s.next_backward < 0) {
    return FailedPrecondition("byte_lm Backward of layer " + std::to_string(layer) +
                              " with no backward pending: run Forward through layer " +
                              std::to_string(last_layer) +
                              " first (each forward allows one backward pass)");
  }
  if (layer != s.next_backward) {
    return FailedPrecondition("byte_lm Backward of layer " + std::to_string(layer) +
                              " out of order: the next layer is " +
                              std::to_string(s.next_backward) + " (backward runs layers " +
                              std::to_string(last_layer) + "..0 in order)");
  }
  const size_t first = s.layer_first[size_t(layer)];
  const size_t last = s.layer_first[size_t(layer) + 1];
  STRATA_RETURN_IF_ERROR(CheckLayerSpans(s.params, first, last, layer, params, "parameter"));
  STRATA_RETURN_IF_ERROR(CheckLayerSpans(s.params, first, last, layer, grads, "gradient"));

  const Eigen::Index n = s.rows();
  const Eigen::Index d = config_.width;
  // From here on s.hidden holds dL/dh, the gradient flowing down the residual stream. It is
  // unscaled: loss_scale multiplies only what is written to `grads`, so each call may use its
  // own scale and the internal values never overflow.
  MatrixMap hidden_grad(s.hidden.data(), n, d);

  if (layer == last_layer) {
    ConstRowVectorMap gain(params[0].data(), d);
    ConstRowVectorMap bias(params[1].data(), d);
    ConstMatrixMap head_weight(params[2].data(), kVocab, d);
    RowVectorMap gain_grad(grads[0].data(), d);
    RowVectorMap bias_grad(grads[1].data(), d);
    MatrixMap head_weight_grad(grads[2].data(), kVocab, d);
    RowVectorMap head_bias_grad(grads[3].data(), kVocab);
    ConstMatrixMap xhat(s.final_xhat.data(), n, d);
    ConstColumnMap inv_std(s.final_inv_std.data(), n);
    MatrixMap ln_out(s.ln_out.data(), n, d);
    MatrixMap logits_grad(s.probs.data(), n, kVocab);

    // d(mean cross-entropy)/dlogits = (softmax - onehot(target)) / N, in place of the softmax.
    for (Eigen::Index row = 0; row < n; ++row) logits_grad(row, s.Target(row)) -= 1.0f;
    logits_grad *= float(1.0 / double(n));
    SumRows(logits_grad, head_bias_grad);
    LayerNormOutput(xhat, gain, bias, ln_out);
    head_weight_grad.noalias() = logits_grad.transpose() * ln_out;
    const RowMatrix ln_out_grad = logits_grad * head_weight;
    LayerNormBackward(ln_out_grad, xhat, inv_std, gain, gain_grad, bias_grad, hidden_grad,
                      /*accumulate=*/false);
  } else if (layer >= 1) {
    const State::BlockActivations& block = s.blocks[size_t(layer - 1)];
    ConstRowVectorMap gain(params[0].data(), d);
    ConstRowVectorMap bias(params[1].data(), d);
    ConstMatrixMap fc1_weight(params[2].data(), 4 * d, d);
    ConstMatrixMap fc2_weight(params[4].data(), d, 4 * d);
    RowVectorMap gain_grad(grads[0].data(), d);
    RowVectorMap bias_grad(grads[1].data(), d);
    MatrixMap fc1_weight_grad(grads[2].data(), 4 * d, d);
    RowVectorMap fc1_bias_grad(grads[3].data(), 4 * d);
    MatrixMap fc2_weight_grad(grads[4].data(), d, 4 * d);
    RowVectorMap fc2_bias_grad(grads[5].data(), d);
    ConstMatrixMap xhat(block.xhat.data(), n, d);
    ConstColumnMap inv_std(block.inv_std.data(), n);
    ConstMatrixMap pre_gelu(block.pre_gelu.data(), n, 4 * d);
    MatrixMap ln_out(s.ln_out.data(), n, d);
    MatrixMap gelu(s.gelu.data(), n, 4 * d);

    // The block adds its branch to h, so dL/d(branch output) is dL/dh itself.
    SumRows(hidden_grad, fc2_bias_grad);
    Gelu(block.pre_gelu.data(), s.gelu.data(), n * 4 * d);
    fc2_weight_grad.noalias() = hidden_grad.transpose() * gelu;
    gelu.noalias() = hidden_grad * fc2_weight;                // dL/dgelu, reusing the GELU buffer.
    GeluBackward(pre_gelu.data(), s.gelu.data(), n * 4 * d);  // Now dL/du.
    SumRows(gelu, fc1_bias_grad);
    LayerNormOutput(xhat, gain, bias, ln_out);
    fc1_weight_grad.noalias() = gelu.transpose() * ln_out;
    const RowMatrix ln_out_grad = gelu * fc1_weight;
    LayerNormBackward(ln_out_grad, xhat, inv_std, gain, gain_grad, bias_grad, hidden_grad,
                      /*accumulate=*/true);
  } else {
    for (int j = 0; j < config_.context; ++j) {
      MatrixMap table_grad(grads[size_t(j)].data(), kVocab, d);
      table_grad.setZero();
      for (Eigen::Index row = 0; row < n; ++row) {
        table_grad.row(s.Input(row, j)) += hidden_grad.row(row);
      }
    }
  }

  if (loss_scale != 1.0f) {
    for (const std::span<float>& grad : grads) {
      ArrayMap(grad.data(), Eigen::Index(grad.size())) *= loss_scale;
    }
  }
  s.next_backward = layer - 1;
  return Status::Ok();
}

}  // namespace strata::examples
