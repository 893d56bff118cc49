// strata._strata: the thin binding of the offload engine for Python.
//
// Lifetime: views of chunk memory hold a reference to their engine, so the engine (and the
// device memory under a model's parameters) lives until the last view and the last Python
// reference are gone; there is deliberately no close() that could free memory under a view
// (strata.torch gives parameters their own memory when their optimizer goes, so the engine goes
// with the optimizer unless something else still views it).
//
// It exposes Engine's trainer contract one call for one call; everything torch-specific
// (parameters as views, autograd hooks, param_groups, state_dict) is plain Python in
// strata/torch. Tensors cross as DLPack arrays: views of the engine's device memory go out with
// the engine as their owner (a view keeps the engine alive), and values come in as contiguous
// fp32 host arrays. No torch header or library is needed to build this file.
//
// Every call that can wait (Acquire, GradsReady, Step, state reads and writes, destruction)
// releases the GIL; no Python code ever runs on an engine thread. The engine's messages, which
// any of its threads may log, wait in a queue (LogRelay) and go to Python's `logging` and
// `warnings` (strata/_log.py) when a call returns, with the GIL held. Errors become Python
// exceptions carrying the engine's message: ValueError (InvalidArgument), FileNotFoundError,
// MemoryError (ResourceExhausted), OSError (IoError), NotImplementedError (Unavailable) and
// RuntimeError for the rest.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/cuda_device.h"
#include "strata/core/host_device.h"
#include "strata/core/log.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/adam_benchmark.h"
#include "strata/offload/device_sizing.h"
#include "strata/offload/engine.h"
#include "strata/offload/ranks.h"

namespace nb = nanobind;

namespace strata::python {
namespace {

using offload::ChunkView;
using offload::Engine;
using offload::ParameterSpec;
using offload::ParameterState;
using offload::TrainerStream;

/// An fp32 host array as the engine reads values from (and writes states into).
using HostFloats = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

[[noreturn]] void Raise(const Status& status) {
  PyObject* type = PyExc_RuntimeError;
  switch (status.code()) {
    case StatusCode::kInvalidArgument: type = PyExc_ValueError; break;
    case StatusCode::kNotFound: type = PyExc_FileNotFoundError; break;
    case StatusCode::kResourceExhausted: type = PyExc_MemoryError; break;
    case StatusCode::kIoError: type = PyExc_OSError; break;
    case StatusCode::kUnavailable: type = PyExc_NotImplementedError; break;
    default: break;
  }
  PyErr_SetString(type, status.message().c_str());
  throw nb::python_error();
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Check(Result<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}

/// The engine's log messages on their way to Python. The engine logs from any of its threads,
/// which must never take the GIL (the trainer thread may hold it while it waits for them), so
/// the sink only queues; Deliver, with the GIL held, hands the queue to strata._log.emit, which
/// sends warnings through `warnings` and the rest through the `strata` logger. A message waits
/// at most until the next engine call returns (or strata._log.flush, at exit).
class LogRelay {
 public:
  static LogRelay& Get() {
    static LogRelay* const relay = new LogRelay;  // Never destroyed: engine threads may log late.
    return *relay;
  }

  /// Makes the relay the process's log sink (once, at import).
  void Install() {
    SetLogSink([this](LogLevel level, std::string_view message) { Push(level, message); });
  }

  /// Any thread, without the GIL.
  void Push(LogLevel level, std::string_view message) {
    std::lock_guard lock(mutex_);
    if (queue_.size() == kMaxQueued) {
      queue_.pop_front();
      ++dropped_;
    }
    queue_.emplace_back(level, std::string(message));
  }

  /// With the GIL: every queued message to strata._log.emit, in order. A handler that raises
  /// (warnings turned into errors, say) is reported as unraisable rather than thrown out of an
  /// engine call that has already succeeded.
  void Deliver() {
    std::deque<std::pair<LogLevel, std::string>> batch;
    size_t dropped = 0;
    {
      std::lock_guard lock(mutex_);
      if (queue_.empty() && dropped_ == 0) return;
      batch.swap(queue_);
      dropped = std::exchange(dropped_, 0);
    }
    try {
      nb::object emit = nb::module_::import_("strata._log").attr("emit");
      if (dropped > 0) {
        emit(int(LogLevel::kWarning), std::to_string(dropped) +
                                          " earlier engine messages were dropped (more than " +
                                          std::to_string(kMaxQueued) + " between two calls)");
      }
      for (const auto& [level, message] : batch) emit(int(level), message);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("strata: delivering the engine's log messages");
    }
  }

 private:
  static constexpr size_t kMaxQueued = 4096;
  std::mutex mutex_;
  std::deque<std::pair<LogLevel, std::string>> queue_;
  size_t dropped_ = 0;
};

/// Runs `call` (an engine call that may wait) with the GIL released and returns its Status or
/// Result, to be checked once the GIL is held again; what the engine logged meanwhile goes to
/// Python first.
template <typename Call>
auto Unlocked(Call&& call) {
  auto result = [&] {
    nb::gil_scoped_release unlocked;
    return call();
  }();
  LogRelay::Get().Deliver();
  return result;
}

nb::dlpack::dtype ToDlpack(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return nb::dtype<float>();
    case DType::kFp16: return {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kBf16: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  return nb::dtype<float>();
}

/// One parameter as Python registers it: (name, shape, initial fp32 values or None,
/// weight decay or None, lr scale, frozen).
using PyParameter = std::tuple<std::string, std::vector<int64_t>, std::optional<HostFloats>,
                               std::optional<double>, double, bool>;

/// A config document as `strata config check` reads it: its options in Strata's format (JSON
/// text), the format it was read as, the DeepSpeed keys ignored, the "auto" values resolved and
/// the batch sizes.
nb::dict ConfigDict(const LoadedConfig& config) {
  nb::dict out;
  out["options"] = OptionsToJson(config.options);
  out["format"] = std::string(ConfigFormatName(config.format));
  out["ignored_keys"] = config.ignored_keys;
  out["auto_resolved"] = config.auto_resolved;
  out["has_optimizer"] = config.has_optimizer;
  out["train_batch_size"] = config.train_batch_size;
  out["micro_batch_size"] = config.micro_batch_size;
  return out;
}

ConfigFormat FormatNamed(const std::string& name) {
  if (name == "auto") return ConfigFormat::kAuto;
  if (name == "strata") return ConfigFormat::kStrata;
  if (name == "deepspeed") return ConfigFormat::kDeepSpeed;
  Raise(InvalidArgument("format: expected auto, strata or deepspeed, got \"" + name + "\""));
  return ConfigFormat::kAuto;
}

/// The engine and the device it runs on (declared first: destroyed after the engine). The
/// engine's destructor waits for its work in flight; its threads never call into Python, so
/// that wait cannot deadlock on the GIL.
class PyEngine {
 public:
  PyEngine(const std::string& config_json, const std::vector<PyParameter>& parameters,
           bool fit_host_device) {
    LoadedConfig config =
        Check(ParseConfig(config_json, ConfigFormat::kStrata, "<strata.Engine options>"));
    EngineOptions& options = config.options;
    std::vector<ParameterSpec> specs;
    specs.reserve(parameters.size());
    for (const auto& [name, shape, values, weight_decay, lr_scale, frozen] : parameters) {
      ParameterSpec spec{.name = name,
                         .shape = shape,
                         .weight_decay = weight_decay,
                         .lr_scale = lr_scale,
                         .frozen = frozen};
      if (values) spec.initial_values = std::span<const float>(values->data(), values->size());
      specs.push_back(std::move(spec));
    }
    if (options.device.kind == DeviceKind::kCuda) {
      device_ = Check(CreateCudaDevice({.device_index = options.device.cuda_device,
                                        .memory_budget_bytes = options.device.cuda_memory_bytes}));
    } else {
      if (fit_host_device) {
        // CPU tensors: every chunk where the tensors view it (offload/device_sizing.h).
        options.device.host_device_memory_bytes =
            Check(offload::DeviceBytesToFit(options, specs, offload::DeviceFit::kAllChunks));
      }
      // CPU tensors: the device is the CPU itself, so the engine reads gradients and writes
      // parameters in place rather than copying them between two kinds of host memory.
      device_ =
          Check(CreateHostDevice({.memory_budget_bytes = options.device.host_device_memory_bytes,
                                  .copy_bytes_per_second = options.device.copy_bandwidth_gbps * 1e9,
                                  .host_accessible = true}));
    }
    engine_ = Check(Unlocked([&] { return Engine::Create(options, *device_, specs); }));
    device_kind_ = options.device.kind;
    device_index_ = options.device.kind == DeviceKind::kCuda ? options.device.cuda_device : 0;
  }

  Engine& engine() { return *engine_; }

  /// Views of an acquired chunk's parameters and gradients (None for a frozen chunk) as 1-D
  /// DLPack arrays owned by `self`.
  std::tuple<nb::object, nb::object> Acquire(nb::handle self, size_t chunk) {
    Engine& e = engine();
    const ChunkView view = Check(Unlocked([&] { return e.Acquire(chunk); }));
    return {View(self, view.params, view), view.grads ? View(self, view.grads, view) : nb::none()};
  }

  void Release(size_t chunk, uintptr_t stream) {
    Engine& e = engine();
    Unlocked([&] {
      e.Release(chunk, TrainerStream{reinterpret_cast<void*>(stream)});
      return 0;
    });
  }

  void GradsReady(size_t chunk, uintptr_t stream) {
    Engine& e = engine();
    Check(Unlocked(
        [&] { return e.GradsReady(chunk, TrainerStream{reinterpret_cast<void*>(stream)}); }));
  }

  nb::dict Step() {
    Engine& e = engine();
    const offload::StepReport report = Check(Unlocked([&] { return e.Step().get(); }));
    nb::dict out;
    offload::StepReport::ForEachField(
        [&](const char* name, auto member) { out[name] = report.*member; });
    return out;
  }

  void AbandonStep() {
    Engine& e = engine();
    Check(Unlocked([&] { return e.AbandonStep(); }));
  }

  /// Many states at once: (parameter, state, fp32 array) each; one pass per chunk.
  void ReadStates(const std::vector<std::tuple<size_t, int, HostFloats>>& reads) {
    Engine& e = engine();
    std::vector<offload::ParameterStateRead> batch;
    for (const auto& [parameter, state, out] : reads) {
      batch.push_back(
          {.parameter = parameter, .state = StateOf(state), .out = {out.data(), out.size()}});
    }
    Check(Unlocked([&] { return e.ReadParameterStates(batch); }));
  }

  void WriteStates(const std::vector<std::tuple<size_t, int, HostFloats>>& writes) {
    Engine& e = engine();
    std::vector<offload::ParameterStateWrite> batch;
    for (const auto& [parameter, state, values] : writes) {
      batch.push_back({.parameter = parameter,
                       .state = StateOf(state),
                       .values = {values.data(), values.size()}});
    }
    Check(Unlocked([&] { return e.WriteParameterStates(batch); }));
  }

  nb::dict Counters() {
    const offload::EngineCounters c = engine().counters();
    nb::dict out;
    offload::EngineCounters::ForEachField([&](const char* name, auto member) {
      // This engine is one rank's (strata.torch's ranks meet in torch.distributed), so its
      // collectives' counters would always be 0: metrics() has never had them.
      const std::string_view counter = name;
      if (counter == "reduce_scatter_bytes" || counter == "all_gather_bytes") return;
      out[name] = c.*member;
    });
    for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
      const offload::TierUsage usage = engine().tier_usage(tier);
      const std::string name(TierName(tier));
      out[(name + "_used_bytes").c_str()] = usage.used_bytes;
      out[(name + "_peak_bytes").c_str()] = usage.peak_bytes;
      out[(name + "_budget_bytes").c_str()] = usage.budget_bytes;
    }
    return out;
  }

  int device_kind() const { return int(device_kind_); }
  int device_index() const { return device_index_; }

 private:
  static ParameterState StateOf(int state) {
    if (state < 0 || state > 2) {
      Raise(InvalidArgument("state " + std::to_string(state) +
                            " is not 0 (master), 1 (exp_avg) or 2 (exp_avg_sq)"));
    }
    return ParameterState(state);
  }

  nb::object View(nb::handle self, void* data, const ChunkView& view) const {
    const size_t shape[1] = {view.numel};
    const int device_type =
        device_kind_ == DeviceKind::kCuda ? nb::device::cuda::value : nb::device::cpu::value;
    nb::ndarray<> array(data, 1, shape, self, nullptr, ToDlpack(view.dtype), device_type,
                        device_index_);
    return nb::cast(array, nb::rv_policy::reference);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Engine> engine_;
  DeviceKind device_kind_ = DeviceKind::kHost;
  int device_index_ = 0;
};

}  // namespace
}  // namespace strata::python

NB_MODULE(_strata, m) {
  using namespace strata;
  using namespace strata::python;
  m.doc() = "Strata's offload engine (the binding under strata.torch)";
  LogRelay::Get().Install();
  m.def(
      "deliver_logs", [] { LogRelay::Get().Deliver(); },
      "Hands the engine's queued log messages to strata._log.emit now.");
  m.def("built_with_cuda", &BuiltWithCuda, "Whether this build contains CudaDevice.");
  m.def(
      "parse_bytes", [](const std::string& text) { return Check(ParseBytes(text)); },
      "Bytes in '64MiB', '1.5GiB', '1e9' (what config sizes accept).");

  m.def(
      "load_config",
      [](const std::string& path, const std::string& format, int world_size) {
        return ConfigDict(Check(LoadConfigFile(path, FormatNamed(format), world_size)));
      },
      nb::arg("path"), nb::arg("format") = "auto", nb::arg("world_size") = 1,
      "Reads and checks a Strata or DeepSpeed config file as `strata config check` does (the "
      "same errors, as ValueError); returns a dict: options (Strata-format JSON text), format, "
      "ignored_keys, auto_resolved, has_optimizer, train_batch_size, micro_batch_size.");
  m.def(
      "parse_config",
      [](const std::string& text, const std::string& format, const std::string& source,
         int world_size) {
        return ConfigDict(Check(ParseConfig(text, FormatNamed(format), source, world_size)));
      },
      nb::arg("text"), nb::arg("format") = "auto", nb::arg("source") = "<string>",
      nb::arg("world_size") = 1, "load_config for a document in memory; errors name `source`.");

  m.def(
      "detect_ranks",
      [] {
        const offload::RankInfo r = Check(offload::DetectRanks());
        nb::dict out;
        out["rank"] = r.rank;
        out["size"] = r.size;
        out["local_rank"] = r.local_rank;
        out["local_size"] = r.local_size;
        out["launcher"] = r.launcher;
        return out;
      },
      "This process's data-parallel rank, world size and place on its node, read from the "
      "environment its launcher set (torchrun, mpirun, srun, PMIx; offload/ranks.h), and the "
      "launcher's name ('none' for a lone process). ValueError naming a malformed variable.");

  m.def(
      "bench_adam",
      [](size_t numel, int threads, int runs) {
        cpu_adam::AdamBenchmarkOptions options;
        options.numel = numel;
        options.threads = threads;
        options.timed_runs = runs;
        const cpu_adam::AdamBenchmarkResult r =
            Check(Unlocked([&] { return cpu_adam::RunAdamBenchmark(options); }));
        nb::dict out;
        out["simd"] = std::string(cpu_adam::SimdLevelName(r.simd_level));
        out["threads"] = r.threads;
        out["bytes_per_param"] = r.bytes_per_param;
        out["step_seconds"] = r.step_median_seconds;
        out["roofline_seconds"] = r.roofline_median_seconds;
        return out;
      },
      nb::arg("numel"), nb::arg("threads") = 0, nb::arg("runs") = 5,
      "`strata bench adam` in-process: the median seconds of one fp32 AdamW step over numel "
      "parameters and of the roofline kernel that moves the same bytes (28 per parameter).");

  // Tensors viewing an engine's memory (and so the engine) may outlive this module at exit.
  nb::set_leak_warnings(false);

  nb::class_<PyEngine>(m, "Engine", nb::is_weak_referenceable())
      .def(nb::init<const std::string&, const std::vector<PyParameter>&, bool>(),
           nb::arg("config_json"), nb::arg("parameters"), nb::arg("fit_host_device") = true,
           "Creates an engine from a Strata-format JSON config and parameters given as (name, "
           "shape, fp32 values or None, weight_decay or None, lr_scale, frozen) tuples. "
           "fit_host_device sizes HostDevice's memory to the chunks.")
      .def_prop_ro("chunk_count", [](PyEngine& self) { return self.engine().chunk_count(); })
      .def_prop_ro("parameter_count",
                   [](PyEngine& self) { return self.engine().layout().parameter_count(); })
      .def_prop_ro(
          "working_dtype",
          [](PyEngine& self) { return std::string(DTypeName(self.engine().working_dtype())); })
      .def_prop_ro("device_kind",
                   [](PyEngine& self) {
                     return self.device_kind() == int(DeviceKind::kCuda) ? "cuda" : "host";
                   })
      .def(
          "location",
          [](PyEngine& self, size_t parameter) {
            const offload::ChunkLayout& layout = self.engine().layout();
            if (parameter >= layout.parameter_count()) {
              Raise(InvalidArgument("parameter " + std::to_string(parameter) + " does not exist"));
            }
            const offload::ParameterLocation& l = layout.location(parameter);
            return std::make_tuple(l.chunk, l.offset, l.numel);
          },
          nb::arg("parameter"), "(chunk, offset, numel) of a parameter, by registration index.")
      .def(
          "chunk",
          [](PyEngine& self, size_t chunk) {
            Engine& e = self.engine();
            if (chunk >= e.chunk_count()) {
              Raise(InvalidArgument("chunk " + std::to_string(chunk) + " does not exist"));
            }
            const offload::ChunkInfo& info = e.layout().chunk(chunk);
            const offload::ChunkPlacement& placement = e.placement(chunk);
            return std::make_tuple(
                info.numel, info.first_parameter, info.parameter_count, info.frozen,
                std::string(TierName(placement.params)),
                placement.optimizer_states
                    ? std::optional(std::string(TierName(*placement.optimizer_states)))
                    : std::nullopt);
          },
          nb::arg("chunk"),
          "(numel, first_parameter, parameter_count, frozen, params tier, states tier or None).")
      .def(
          "acquire",
          [](nb::handle self, size_t chunk) {
            return nb::cast<PyEngine&>(self).Acquire(self, chunk);
          },
          nb::arg("chunk"),
          "Pins a chunk on the device; returns DLPack views of its parameters and gradients "
          "(None when frozen).")
      .def("release", &PyEngine::Release, nb::arg("chunk"), nb::arg("stream") = 0,
           "Unpins a chunk; the trainer's work on `stream` (a native stream handle, 0 = the "
           "device's compute stream) finishes first.")
      .def("grads_ready", &PyEngine::GradsReady, nb::arg("chunk"), nb::arg("stream") = 0,
           "Backward has written the chunk's gradients by work queued on `stream` so far.")
      .def("step", &PyEngine::Step, "Finishes the optimizer step; returns its report.")
      .def("abandon_step", &PyEngine::AbandonStep,
           "Drops the open step's gradients and every update made ahead of step() "
           "(optimizer.recheck_gradients).")
      .def_prop_ro("loss_scale", [](PyEngine& self) { return self.engine().loss_scale(); })
      .def_prop_ro("step_count", [](PyEngine& self) { return self.engine().step_count(); })
      .def_prop_ro("iteration_count",
                   [](PyEngine& self) { return self.engine().iteration_count(); })
      .def(
          "set_learning_rate", [](PyEngine& self, double lr) { self.engine().SetLearningRate(lr); },
          nb::arg("lr"), "The base learning rate of the steps whose gradients come next.")
      .def(
          "set_step_count",
          [](PyEngine& self, int64_t steps) { Check(self.engine().SetStepCount(steps)); },
          nb::arg("steps"))
      .def("read_states", &PyEngine::ReadStates, nb::arg("reads"),
           "Copies states (parameter, state, out) -- state 0 master, 1 exp_avg, 2 exp_avg_sq -- "
           "into fp32 arrays, one pass per chunk.")
      .def("write_states", &PyEngine::WriteStates, nb::arg("writes"),
           "Replaces states (parameter, state, values); a master also sets the working value. "
           "One pass per chunk.")
      .def("counters", &PyEngine::Counters, "Bytes moved, optimizer time and tier usage.")
      .def(
          "metrics_text", [](PyEngine& self) { return self.engine().metrics().RenderPrometheus(); },
          "The engine's metrics in Prometheus' text format.");
}
