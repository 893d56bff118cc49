// Tests for strata/examples/byte_lm.h: gradients against finite differences, the initial loss,
// a short training run that must learn a repeated sentence, and the error paths.

#include "strata/examples/byte_lm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace strata::examples {
namespace {

// A model with its parameters and gradients, driven the way the trainer drives it: one layer at
// a time, forward 0..L+1 then backward L+1..0.
class Harness {
 public:
  Harness(ByteLmConfig config, uint64_t seed)
      : config_(config),
        infos_(ByteLmParameters(config)),
        params_(InitByteLmParameters(config, seed)),
        model_(config) {
    for (const std::vector<float>& p : params_) grads_.emplace_back(p.size(), 0.0f);
  }

  [[nodiscard]] const ByteLmConfig& config() const { return config_; }
  [[nodiscard]] const std::vector<ParameterInfo>& infos() const { return infos_; }
  std::vector<std::vector<float>>& params() { return params_; }
  std::vector<std::vector<float>>& grads() { return grads_; }
  ByteLm& model() { return model_; }
  [[nodiscard]] int layer_count() const { return ByteLmLayerCount(config_); }

  [[nodiscard]] std::vector<std::span<const float>> ParamSpans(int layer) const {
    std::vector<std::span<const float>> spans;
    for (size_t i = 0; i < infos_.size(); ++i) {
      if (infos_[i].layer == layer) spans.emplace_back(params_[i]);
    }
    return spans;
  }
  std::vector<std::span<float>> GradSpans(int layer) {
    std::vector<std::span<float>> spans;
    for (size_t i = 0; i < infos_.size(); ++i) {
      if (infos_[i].layer == layer) spans.emplace_back(grads_[i]);
    }
    return spans;
  }

  // Begin + every Forward; returns the loss (NaN after a failure, which is also reported).
  double Forward(const std::vector<uint8_t>& tokens, int batch, int seq) {
    const Status begun = model_.Begin(tokens, batch, seq);
    EXPECT_TRUE(begun.ok()) << begun.ToString();
    double loss = std::numeric_limits<double>::quiet_NaN();
    for (int layer = 0; layer < layer_count(); ++layer) {
      Result<double> result = model_.Forward(layer, ParamSpans(layer));
      EXPECT_TRUE(result.ok()) << "layer " << layer << ": " << result.status().ToString();
      if (!result.ok()) return std::numeric_limits<double>::quiet_NaN();
      loss = *result;
    }
    return loss;
  }

  void Backward(float loss_scale = 1.0f) {
    for (int layer = layer_count() - 1; layer >= 0; --layer) {
      const Status status = model_.Backward(layer, ParamSpans(layer), GradSpans(layer), loss_scale);
      EXPECT_TRUE(status.ok()) << "layer " << layer << ": " << status.ToString();
    }
  }

 private:
  ByteLmConfig config_;
  std::vector<ParameterInfo> infos_;
  std::vector<std::vector<float>> params_;
  std::vector<std::vector<float>> grads_;
  ByteLm model_;
};

std::vector<uint8_t> RandomTokens(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> tokens(count);
  for (uint8_t& t : tokens) t = uint8_t(byte(random));
  return tokens;
}

bool EndsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ByteLmConfigTest, Validate) {
  EXPECT_TRUE(ByteLmConfig{}.Validate().ok());
  EXPECT_TRUE((ByteLmConfig{.context = 1, .width = 8, .layers = 1}).Validate().ok());
  EXPECT_TRUE((ByteLmConfig{.context = 64, .width = 1024, .layers = 1024}).Validate().ok());
  for (const ByteLmConfig& bad :
       {ByteLmConfig{.context = 0}, ByteLmConfig{.context = 65}, ByteLmConfig{.width = 0},
        ByteLmConfig{.width = 12}, ByteLmConfig{.width = -8}, ByteLmConfig{.layers = 0},
        ByteLmConfig{.layers = 1025}}) {
    const Status status = bad.Validate();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  }
  EXPECT_TRUE(Contains(ByteLmConfig{.width = 12}.Validate().message(), "multiple of 8"));
}

TEST(ByteLmParametersTest, NamesShapesAndLayers) {
  const ByteLmConfig config{.context = 3, .width = 16, .layers = 2};
  const std::vector<ParameterInfo> params = ByteLmParameters(config);
  EXPECT_EQ(ByteLmLayerCount(config), 4);
  ASSERT_EQ(params.size(), 3u + 2 * 6 + 4);
  const std::vector<std::string> names = {"embed.0",           "embed.1",
                                          "embed.2",           "blocks.0.ln.gain",
                                          "blocks.0.ln.bias",  "blocks.0.fc1.weight",
                                          "blocks.0.fc1.bias", "blocks.0.fc2.weight",
                                          "blocks.0.fc2.bias", "blocks.1.ln.gain",
                                          "blocks.1.ln.bias",  "blocks.1.fc1.weight",
                                          "blocks.1.fc1.bias", "blocks.1.fc2.weight",
                                          "blocks.1.fc2.bias", "final_ln.gain",
                                          "final_ln.bias",     "head.weight",
                                          "head.bias"};
  const std::vector<int> layers = {0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3};
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].name, names[i]);
    EXPECT_EQ(params[i].layer, layers[i]) << params[i].name;
  }
  EXPECT_EQ(params[0].shape, (std::vector<int64_t>{256, 16}));
  EXPECT_EQ(params[3].shape, (std::vector<int64_t>{16}));
  EXPECT_EQ(params[5].shape, (std::vector<int64_t>{64, 16}));
  EXPECT_EQ(params[6].shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(params[7].shape, (std::vector<int64_t>{16, 64}));
  EXPECT_EQ(params[8].shape, (std::vector<int64_t>{16}));
  EXPECT_EQ(params[17].shape, (std::vector<int64_t>{256, 16}));
  EXPECT_EQ(params[18].shape, (std::vector<int64_t>{256}));
  EXPECT_TRUE(ByteLmParameters(ByteLmConfig{.width = 7}).empty());
}

TEST(ByteLmInitTest, GptTwoLikeAndDeterministic) {
  const ByteLmConfig config{.context = 2, .width = 64, .layers = 8};
  const std::vector<ParameterInfo> infos = ByteLmParameters(config);
  const std::vector<std::vector<float>> a = InitByteLmParameters(config, 1);
  const std::vector<std::vector<float>> b = InitByteLmParameters(config, 1);
  const std::vector<std::vector<float>> c = InitByteLmParameters(config, 2);
  ASSERT_EQ(a.size(), infos.size());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a[0], a[1]) << "each parameter draws from its own stream";
  for (size_t i = 0; i < infos.size(); ++i) {
    SCOPED_TRACE(infos[i].name);
    const std::vector<float>& v = a[i];
    if (EndsWith(infos[i].name, ".gain")) {
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 1.0f; }));
    } else if (EndsWith(infos[i].name, ".bias")) {
      EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; }));
    } else {
      double sum = 0.0, sum_sq = 0.0;
      for (float x : v) {
        sum += x;
        sum_sq += double(x) * x;
      }
      const double mean = sum / double(v.size());
      const double std = std::sqrt(sum_sq / double(v.size()) - mean * mean);
      const double expected = EndsWith(infos[i].name, "fc2.weight") ? 0.02 / std::sqrt(16.0) : 0.02;
      EXPECT_NEAR(std, expected, 0.06 * expected);
      EXPECT_NEAR(mean, 0.0, 0.1 * expected);
    }
  }
  // One tensor at a time gives the same values.
  std::vector<float> one(a[7].size());
  ASSERT_TRUE(InitByteLmParameter(config, 1, 7, one).ok());
  EXPECT_EQ(one, a[7]);
  EXPECT_EQ(InitByteLmParameter(config, 1, infos.size(), one).code(), StatusCode::kInvalidArgument);
  std::vector<float> wrong(one.size() + 1);
  const Status status = InitByteLmParameter(config, 1, 7, wrong);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status.message(), infos[7].name)) << status.message();
}

TEST(ByteLmTest, InitialLossIsNearUniform) {
  Harness harness(ByteLmConfig{}, 42);  // context 4, width 256, 4 layers.
  const int batch = 4, seq = 64;
  const double loss = harness.Forward(RandomTokens(size_t(batch) * (seq + 1), 1), batch, seq);
  EXPECT_NEAR(loss, std::log(256.0), 0.1);
}

// The loss of a ByteLm in double precision, written as plain loops that read like the formulas
// in byte_lm.h: an independent reference for the Eigen implementation. `params` in
// ByteLmParameters order.
double ReferenceLoss(const ByteLmConfig& config, const std::vector<std::vector<double>>& params,
                     const std::vector<uint8_t>& tokens, int batch, int seq) {
  const int width = config.width;
  const int hidden = 4 * width;
  auto layer_norm = [&](const std::vector<double>& x, const std::vector<double>& gain,
                        const std::vector<double>& bias) {
    double mean = 0.0, variance = 0.0;
    for (double v : x) mean += v / width;
    for (double v : x) variance += (v - mean) * (v - mean) / width;
    std::vector<double> y(static_cast<size_t>(width));
    for (int i = 0; i < width; ++i) {
      y[i] = (x[i] - mean) / std::sqrt(variance + 1e-5) * gain[i] + bias[i];
    }
    return y;
  };
  auto gelu = [](double u) {
    return 0.5 * u *
           (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (u + 0.044715 * u * u * u)));
  };
  double total = 0.0;
  for (int b = 0; b < batch; ++b) {
    const uint8_t* row = tokens.data() + size_t(b) * (seq + 1);
    for (int t = 0; t < seq; ++t) {
      std::vector<double> h(static_cast<size_t>(width), 0.0);
      for (int j = 0; j < config.context; ++j) {
        const int byte = t >= j ? row[t - j] : 0;
        for (int i = 0; i < width; ++i) h[i] += params[j][size_t(byte) * width + i];
      }
      for (int l = 0; l < config.layers; ++l) {
        const std::vector<double>* block = &params[size_t(config.context) + 6 * size_t(l)];
        const std::vector<double> y = layer_norm(h, block[0], block[1]);
        std::vector<double> a(static_cast<size_t>(hidden));
        for (int o = 0; o < hidden; ++o) {
          double u = block[3][o];
          for (int i = 0; i < width; ++i) u += block[2][size_t(o) * width + i] * y[i];
          a[o] = gelu(u);
        }
        for (int o = 0; o < width; ++o) {
          double out = block[5][o];
          for (int i = 0; i < hidden; ++i) out += block[4][size_t(o) * hidden + i] * a[i];
          h[o] += out;
        }
      }
      const std::vector<double>* head = &params[size_t(config.context) + 6 * size_t(config.layers)];
      const std::vector<double> y = layer_norm(h, head[0], head[1]);
      std::vector<double> logits(256);
      for (int o = 0; o < 256; ++o) {
        logits[o] = head[3][o];
        for (int i = 0; i < width; ++i) logits[o] += head[2][size_t(o) * width + i] * y[i];
      }
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (double l : logits) sum += std::exp(l - max);
      total += std::log(sum) + max - logits[row[t + 1]];
    }
  }
  return total / (double(batch) * seq);
}

// The tiny instance of the gradient checks, with parameters larger than the GPT-2 init so that
// every term (biases, gains, GELU curvature) has a gradient well above finite-difference noise.
struct GradientCheckCase {
  static constexpr ByteLmConfig kConfig{.context = 2, .width = 8, .layers = 2};
  static constexpr int kBatch = 2;
  static constexpr int kSeq = 5;

  GradientCheckCase() : harness(kConfig, 3), tokens(RandomTokens(size_t(kBatch) * (kSeq + 1), 9)) {
    std::mt19937 random(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < harness.infos().size(); ++i) {
      const std::string& name = harness.infos()[i].name;
      const float offset = EndsWith(name, ".gain") ? 1.0f : 0.0f;
      const float scale = EndsWith(name, ".gain")     ? 0.2f
                          : EndsWith(name, ".bias")   ? 0.1f
                          : name.starts_with("embed") ? 1.0f
                                                      : 0.3f;
      for (float& x : harness.params()[i]) x = offset + scale * normal(random);
    }
    loss = harness.Forward(tokens, kBatch, kSeq);
    harness.Backward();
    analytic = harness.grads();
  }

  // The elements of parameter p to check: all of them for parameters of up to 256 elements;
  // for the larger ones (embedding tables, head.weight) every row of an embedding table that
  // the inputs use (the only rows with a gradient) and 128 random elements.
  [[nodiscard]] std::vector<size_t> ElementsToCheck(size_t p) const {
    const ParameterInfo& info = harness.infos()[p];
    const size_t count = analytic[p].size();
    std::vector<size_t> elements;
    if (count <= 256) {
      for (size_t e = 0; e < count; ++e) elements.push_back(e);
      return elements;
    }
    if (info.name.starts_with("embed.")) {
      const auto width = size_t(info.shape[1]);
      std::vector<bool> used(256, false);
      used[0] = true;  // Positions before the start of a row read byte 0.
      for (int b = 0; b < kBatch; ++b) {
        for (int t = 0; t < kSeq; ++t) used[tokens[size_t(b) * (kSeq + 1) + t]] = true;
      }
      for (size_t byte = 0; byte < 256; ++byte) {
        for (size_t i = 0; used[byte] && i < width; ++i) elements.push_back(byte * width + i);
      }
    }
    std::mt19937 generator(static_cast<uint32_t>(p));
    std::uniform_int_distribution<size_t> any(0, count - 1);
    for (int i = 0; i < 128; ++i) elements.push_back(any(generator));
    std::sort(elements.begin(), elements.end());
    elements.erase(std::unique(elements.begin(), elements.end()), elements.end());
    return elements;
  }

  // Compares the gradient elements that ElementsToCheck picks with numeric(p, e), the
  // finite-difference derivative for element e of parameter p. The error is
  // |a - n| / max(|a|, |n|, floor): the floor keeps (near) zero gradients from dividing noise by
  // zero. Returns the worst error and reports each parameter above `limit`.
  template <typename Numeric>
  double Check(double floor, double limit, Numeric numeric) {
    double worst = 0.0, worst_absolute = 0.0;
    std::string where;
    for (size_t p = 0; p < analytic.size(); ++p) {
      double worst_here = 0.0;
      for (size_t e : ElementsToCheck(p)) {
        const double a = analytic[p][e];
        const double n = numeric(p, e);
        const double error = std::abs(a - n) / std::max({std::abs(a), std::abs(n), floor});
        worst_here = std::max(worst_here, error);
        worst_absolute = std::max(worst_absolute, std::abs(a - n));
        if (error > worst) {
          worst = error;
          where = harness.infos()[p].name + "[" + std::to_string(e) + "] (analytic " +
                  std::to_string(a) + ", numeric " + std::to_string(n) + ")";
        }
      }
      EXPECT_LT(worst_here, limit) << harness.infos()[p].name;
    }
    std::printf("worst relative error %.3g at %s; worst absolute error %.3g\n", worst,
                where.c_str(), worst_absolute);
    return worst;
  }

  Harness harness;
  std::vector<uint8_t> tokens;
  double loss = 0.0;
  std::vector<std::vector<float>> analytic;
};

// Every parameter against central differences of the model's own fp32 loss.
// The step trades truncation error (step^2) against fp32 rounding of the loss (~1e-7 / step);
// 1e-2 is near the best of both, and the error left is a few 1e-3 of small gradients.
TEST(ByteLmTest, GradientsMatchFiniteDifferencesOfFp32Loss) {
  GradientCheckCase c;
  constexpr double kStep = 1e-2;
  const double worst = c.Check(/*floor=*/1e-3, /*limit=*/1e-2, [&](size_t p, size_t e) {
    std::vector<float>& values = c.harness.params()[p];
    const float original = values[e];
    values[e] = float(original + kStep);
    const float up = values[e];
    const double loss_up = c.harness.Forward(c.tokens, c.kBatch, c.kSeq);
    values[e] = float(original - kStep);
    const float down = values[e];
    const double loss_down = c.harness.Forward(c.tokens, c.kBatch, c.kSeq);
    values[e] = original;
    // Divide by the step actually taken, after rounding to fp32.
    return (loss_up - loss_down) / (double(up) - double(down));
  });
  EXPECT_LT(worst, 1e-2);
}

// The same gradients against central differences of ReferenceLoss in double, where the finite
// differences are exact to ~1e-9: what is left is the fp32 rounding of the analytic gradients.
TEST(ByteLmTest, GradientsMatchDoubleReference) {
  GradientCheckCase c;
  std::vector<std::vector<double>> params;
  for (const std::vector<float>& p : c.harness.params()) params.emplace_back(p.begin(), p.end());
  EXPECT_NEAR(c.loss, ReferenceLoss(c.kConfig, params, c.tokens, c.kBatch, c.kSeq), 1e-5);
  constexpr double kStep = 1e-6;
  const double worst = c.Check(/*floor=*/1e-4, /*limit=*/1e-3, [&](size_t p, size_t e) {
    const double original = params[p][e];
    params[p][e] = original + kStep;
    const double loss_up = ReferenceLoss(c.kConfig, params, c.tokens, c.kBatch, c.kSeq);
    params[p][e] = original - kStep;
    const double loss_down = ReferenceLoss(c.kConfig, params, c.tokens, c.kBatch, c.kSeq);
    params[p][e] = original;
    return (loss_up - loss_down) / (2.0 * kStep);
  });
  EXPECT_LT(worst, 1e-3);
}

TEST(ByteLmTest, LossScaleMultipliesGradientsExactly) {
  const ByteLmConfig config{.context = 3, .width = 16, .layers = 2};
  const int batch = 3, seq = 7;
  Harness harness(config, 11);
  const std::vector<uint8_t> tokens = RandomTokens(size_t(batch) * (seq + 1), 2);
  harness.Forward(tokens, batch, seq);
  harness.Backward(1.0f);
  const std::vector<std::vector<float>> unscaled = harness.grads();
  harness.Forward(tokens, batch, seq);
  harness.Backward(1024.0f);
  for (size_t p = 0; p < unscaled.size(); ++p) {
    for (size_t e = 0; e < unscaled[p].size(); ++e) {
      ASSERT_EQ(harness.grads()[p][e], 1024.0f * unscaled[p][e])
          << harness.infos()[p].name << "[" << e << "]";
    }
  }
}

// The trainer fetches a layer's parameters into a buffer it releases after each call; the model
// must not read them later. Fresh copies, poisoned after each call, give bit-identical results
// from a second instance, even though the copies (parameters and gradients) start one float
// past an aligned address: the results must not depend on where the trainer's buffers lie.
TEST(ByteLmTest, UsesParametersOnlyDuringEachCallWhereverTheyLie) {
  const ByteLmConfig config{.context = 2, .width = 16, .layers = 3};
  const int batch = 2, seq = 9;
  Harness harness(config, 4);
  const std::vector<uint8_t> tokens = RandomTokens(size_t(batch) * (seq + 1), 3);
  const double expected_loss = harness.Forward(tokens, batch, seq);
  harness.Backward();

  // Buffers of one layer, each holding a leading pad float so that its span is misaligned.
  using Buffers = std::vector<std::vector<float>>;
  auto fetch = [&](int layer) {
    Buffers copies;
    for (std::span<const float> s : harness.ParamSpans(layer)) {
      copies.emplace_back(1, 0.0f);
      copies.back().insert(copies.back().end(), s.begin(), s.end());
    }
    return copies;
  };
  auto release = [](Buffers& copies) {
    for (std::vector<float>& c : copies) std::fill(c.begin(), c.end(), std::nanf(""));
  };
  auto views = [](Buffers& buffers) {
    std::vector<std::span<float>> spans;
    for (std::vector<float>& b : buffers) spans.emplace_back(b.data() + 1, b.size() - 1);
    return spans;
  };
  auto const_views = [&](Buffers& buffers) {
    const std::vector<std::span<float>> spans = views(buffers);
    return std::vector<std::span<const float>>(spans.begin(), spans.end());
  };
  ByteLm model(config);
  ASSERT_TRUE(model.Begin(tokens, batch, seq).ok());
  double loss = 0.0;
  for (int layer = 0; layer < harness.layer_count(); ++layer) {
    Buffers copies = fetch(layer);
    Result<double> result = model.Forward(layer, const_views(copies));
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    loss = *result;
    release(copies);
  }
  EXPECT_EQ(loss, expected_loss);
  for (int layer = harness.layer_count() - 1; layer >= 0; --layer) {
    Buffers copies = fetch(layer);
    Buffers grads;
    for (const std::vector<float>& c : copies) grads.emplace_back(c.size(), 7.0f);
    ASSERT_TRUE(model.Backward(layer, const_views(copies), views(grads)).ok());
    release(copies);
    size_t g = 0;
    for (size_t i = 0; i < harness.infos().size(); ++i) {
      if (harness.infos()[i].layer != layer) continue;
      const std::vector<float>& grad = grads[g++];
      EXPECT_TRUE(std::equal(grad.begin() + 1, grad.end(), harness.grads()[i].begin(),
                             harness.grads()[i].end()))
          << harness.infos()[i].name;
    }
  }
}

TEST(ByteLmTest, ForwardRestartsAndEvaluatesWithoutBackward) {
  const ByteLmConfig config{.context = 2, .width = 16, .layers = 2};
  Harness harness(config, 8);
  const std::vector<uint8_t> tokens = RandomTokens(3 * size_t{11}, 6);
  const double first = harness.Forward(tokens, 3, 10);
  const double second = harness.Forward(tokens, 3, 10);  // No backward in between.
  EXPECT_EQ(first, second);
  // Restart in the middle of a pass.
  ASSERT_TRUE(harness.model().Forward(0, harness.ParamSpans(0)).ok());
  ASSERT_TRUE(harness.model().Forward(1, harness.ParamSpans(1)).ok());
  ASSERT_TRUE(harness.model().Forward(0, harness.ParamSpans(0)).ok());
  for (int layer = 1; layer < harness.layer_count(); ++layer) {
    Result<double> result = harness.model().Forward(layer, harness.ParamSpans(layer));
    ASSERT_TRUE(result.ok());
    if (layer + 1 == harness.layer_count()) {
      EXPECT_EQ(*result, first);
    } else {
      EXPECT_EQ(*result, 0.0);
    }
  }
}

// Adam, written out, on a repeated sentence: with 4 bytes of context almost every next byte is
// determined, so the loss must fall far below ln(256) = 5.5.
TEST(ByteLmTest, LearnsARepeatedSentence) {
  const ByteLmConfig config{.context = 4, .width = 32, .layers = 2};
  const int batch = 8, seq = 32, max_steps = 400;
  Harness harness(config, 1);
  std::string text;
  while (text.size() < 4096) text += "the quick brown fox jumps over the lazy dog. ";

  constexpr float kLearningRate = 1e-2f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEpsilon = 1e-8f;
  std::vector<std::vector<float>> m, v;
  for (const std::vector<float>& p : harness.params()) {
    m.emplace_back(p.size(), 0.0f);
    v.emplace_back(p.size(), 0.0f);
  }
  std::mt19937 random(12);
  std::uniform_int_distribution<size_t> start(0, text.size() - seq - 1);
  std::vector<uint8_t> tokens(size_t(batch) * (seq + 1));
  double loss = 0.0;
  int step = 0;
  for (step = 1; step <= max_steps; ++step) {
    for (int b = 0; b < batch; ++b) {
      const size_t s = start(random);
      std::copy(text.begin() + long(s), text.begin() + long(s + seq + 1),
                tokens.begin() + long(b) * (seq + 1));
    }
    loss = harness.Forward(tokens, batch, seq);
    ASSERT_TRUE(std::isfinite(loss));
    if (step == 1) {
      EXPECT_NEAR(loss, std::log(256.0), 0.1);
    }
    if (loss < 1.0) break;
    harness.Backward();
    const float correction1 = 1.0f - std::pow(kBeta1, float(step));
    const float correction2 = 1.0f - std::pow(kBeta2, float(step));
    for (size_t p = 0; p < harness.params().size(); ++p) {
      std::vector<float>& param = harness.params()[p];
      const std::vector<float>& grad = harness.grads()[p];
      for (size_t e = 0; e < param.size(); ++e) {
        m[p][e] = kBeta1 * m[p][e] + (1.0f - kBeta1) * grad[e];
        v[p][e] = kBeta2 * v[p][e] + (1.0f - kBeta2) * grad[e] * grad[e];
        param[e] -=
            kLearningRate * (m[p][e] / correction1) / (std::sqrt(v[p][e] / correction2) + kEpsilon);
      }
    }
  }
  std::printf("loss %.3f after %d steps\n", loss, step);
  EXPECT_LT(loss, 1.0);
}

// The model must predict x_{t+1} without seeing it. On fresh random bytes every step nothing is
// learnable, so the loss must stay near ln(256); a model that leaked the target into its input
// would learn to copy it within a few steps.
TEST(ByteLmTest, DoesNotSeeTheTarget) {
  const ByteLmConfig config{.context = 4, .width = 32, .layers = 1};
  const int batch = 8, seq = 32;
  Harness harness(config, 2);
  double loss = 0.0;
  for (int step = 0; step < 40; ++step) {
    loss = harness.Forward(RandomTokens(size_t(batch) * (seq + 1), 100 + step), batch, seq);
    harness.Backward();
    for (size_t p = 0; p < harness.params().size(); ++p) {
      for (size_t e = 0; e < harness.params()[p].size(); ++e) {
        harness.params()[p][e] -= 0.5f * harness.grads()[p][e];  // A large SGD step.
      }
    }
  }
  EXPECT_GT(loss, 5.0);
}

TEST(ByteLmErrorsTest, Begin) {
  ByteLm model(ByteLmConfig{.context = 2, .width = 8, .layers = 1});
  std::vector<uint8_t> tokens(2 * size_t{6});
  EXPECT_TRUE(model.Begin(tokens, 2, 5).ok());
  Status status = model.Begin(tokens, 2, 6);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status.message(), "14")) << status.message();
  EXPECT_EQ(model.Begin(tokens, 0, 5).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model.Begin(tokens, 2, 0).code(), StatusCode::kInvalidArgument);
  ByteLm invalid(ByteLmConfig{.width = 7});
  EXPECT_EQ(invalid.Begin(tokens, 2, 5).code(), StatusCode::kInvalidArgument);
}

TEST(ByteLmErrorsTest, Forward) {
  const ByteLmConfig config{.context = 2, .width = 8, .layers = 1};
  Harness harness(config, 1);
  ByteLm& model = harness.model();
  EXPECT_EQ(model.Forward(0, harness.ParamSpans(0)).status().code(),
            StatusCode::kFailedPrecondition);  // Before Begin.
  const std::vector<uint8_t> tokens = RandomTokens(2 * size_t{6}, 1);
  ASSERT_TRUE(model.Begin(tokens, 2, 5).ok());
  EXPECT_EQ(model.Forward(-1, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model.Forward(3, {}).status().code(), StatusCode::kInvalidArgument);
  Result<double> result = model.Forward(1, harness.ParamSpans(1));  // Skips layer 0.
  EXPECT_EQ(result.status().code(), StatusCode::kFailedPrecondition);

  std::vector<std::span<const float>> spans = harness.ParamSpans(1);
  ASSERT_TRUE(model.Forward(0, harness.ParamSpans(0)).ok());
  spans.pop_back();
  result = model.Forward(1, spans);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(result.status().message(), "takes 6 parameter spans"))
      << result.status().message();

  spans = harness.ParamSpans(1);
  spans[2] = spans[2].first(spans[2].size() - 1);
  result = model.Forward(1, spans);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(result.status().message(), "blocks.0.fc1.weight"))
      << result.status().message();
  // A rejected call changes nothing: layer 1 is still next.
  EXPECT_TRUE(model.Forward(1, harness.ParamSpans(1)).ok());
}

TEST(ByteLmErrorsTest, Backward) {
  const ByteLmConfig config{.context = 2, .width = 8, .layers = 1};
  Harness harness(config, 1);
  ByteLm& model = harness.model();
  const int last = harness.layer_count() - 1;
  EXPECT_EQ(model.Backward(last, harness.ParamSpans(last), harness.GradSpans(last)).code(),
            StatusCode::kFailedPrecondition);  // Before Begin.
  const std::vector<uint8_t> tokens = RandomTokens(2 * size_t{6}, 1);
  ASSERT_TRUE(model.Begin(tokens, 2, 5).ok());
  ASSERT_TRUE(model.Forward(0, harness.ParamSpans(0)).ok());
  Status status = model.Backward(last, harness.ParamSpans(last), harness.GradSpans(last));
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << "forward has not finished";
  EXPECT_TRUE(Contains(status.message(), "Forward")) << status.message();

  harness.Forward(tokens, 2, 5);
  EXPECT_EQ(model.Backward(0, harness.ParamSpans(0), harness.GradSpans(0)).code(),
            StatusCode::kFailedPrecondition);  // Out of order.
  std::vector<std::span<float>> grads = harness.GradSpans(last);
  grads[2] = grads[2].first(10);
  status = model.Backward(last, harness.ParamSpans(last), grads);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status.message(), "head.weight")) << status.message();
  grads.pop_back();
  EXPECT_EQ(model.Backward(last, harness.ParamSpans(last), grads).code(),
            StatusCode::kInvalidArgument);
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    EXPECT_EQ(model.Backward(last, harness.ParamSpans(last), harness.GradSpans(last), bad).code(),
              StatusCode::kInvalidArgument)
        << bad;
  }
  harness.Backward();  // The rejected calls left the pass intact.
  // One backward per forward.
  EXPECT_EQ(model.Backward(last, harness.ParamSpans(last), harness.GradSpans(last)).code(),
            StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace strata::examples
