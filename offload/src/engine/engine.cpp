// The engine's facade and Impl's own life: construction and teardown, the coroutines it counts,
// and the trainer's calls that only check their arguments before a part does the work. Where
// each chunk is placed is engine_placement.cpp's.
#include <algorithm>

#include "engine/engine_impl.h"
#include "engine/host_memory.h"
#include "strata/core/log.h"
#include "strata/offload/ranks.h"

namespace strata::offload {
namespace {

/// The device budget the engine may use: what the device may still hand out. The device's own
/// budget is the one source of truth (its creator sized it, e.g. from cuda_memory_bytes); the
/// hardware's free memory only lowers it.
uint64_t DeviceBudgetBytes(const Device& device) {
  const DeviceMemoryInfo info = device.memory_info();
  const uint64_t budget_left =
      info.budget_bytes > info.used_bytes ? info.budget_bytes - info.used_bytes : 0;
  return std::min(info.free_bytes, budget_left);
}

}  // namespace

Engine::Impl::Impl(const EngineOptions& options, Device& device, ChunkLayout layout,
                   EngineEnvironment environment)
    : options_(options),
      device_(device),
      layout_(std::move(layout)),
      environment_(std::move(environment)),
      device_budget_(Tier::kDevice, DeviceBudgetBytes(device)),
      host_budget_(Tier::kHost, HostBudgetBytes(options, environment_.ranks_on_node)),
      nvme_budget_(Tier::kNvme, 0) {}

Engine::Impl::~Impl() {
  // Journeys of a gated step whose verdict never came (the trainer stopped mid-backward) give up;
  // everything else started (a step, updates begun during backward, fetches, preloads) ends.
  boost::asio::post(loop_.executor(), [this] { pipeline_.Cancel(); });
  WaitIdle();
  // Collectives still queued would run on the chunks' buffers freed below: the communicator
  // drains them (or fails them) first.
  environment_.communicator.reset();
  // Copies queued on the device's streams (even by a Create that failed half-way) read and
  // write buffers freed below.
  device_.Synchronize().IgnoreError();
  // Preloaded states hold staging buffers, which must go back before the pool is destroyed.
  if (!chunks_.empty()) loop_.Run(pipeline_.preloader().DropAll());
  // The threads that post to the loop may still be inside a post whose completion has already
  // run: join them before the loop goes. Stream threads are drained above; jobs and the
  // I/O thread are waited for here.
  jobs_in_flight_.WaitForAll();
  swap_.reset();
  io_.reset();
}

void Engine::Impl::Spawn(Awaitable<void> work) {
  {
    std::lock_guard lock(work_mutex_);
    ++work_running_;
  }
  boost::asio::co_spawn(loop_.executor(), std::move(work), [this](std::exception_ptr) {
    std::lock_guard lock(work_mutex_);
    if (--work_running_ == 0) work_idle_.notify_all();
  });
}

void Engine::Impl::WaitIdle() {
  std::unique_lock lock(work_mutex_);
  work_idle_.wait(lock, [&] { return work_running_ == 0; });
}

Result<ChunkView> Engine::Impl::Acquire(size_t chunk) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist (the engine has " +
                           std::to_string(chunks_.size()) + ")");
  }
  STRATA_RETURN_IF_ERROR(pipeline_.CheckReadable(chunk, "Acquire(" + std::to_string(chunk) + ")",
                                                 /*acquire=*/true));
  if (!chunks_[chunk].params_sharded || residency_.Held(chunk)) return residency_.Acquire(chunk);
  // Stage 3: every rank gathers the chunk's parameters for this Acquire, whatever its device
  // holds (see param_gather.h), and the chunks expected next ahead of time.
  const auto depth = size_t(std::max(0, options_.placement.prefetch_depth));
  STRATA_ASSIGN_OR_RETURN(const std::byte* gathered,
                          param_gather_.Take(chunk, residency_.Upcoming(chunk, depth)));
  Result<ChunkView> view = residency_.Acquire(chunk, gathered);
  param_gather_.Return(chunk);
  // The other ranks went on from this gather; a retry here would gather once more than they
  // do, and this rank's collectives would no longer match theirs.
  if (!view.ok()) param_gather_.Fail(view.status());
  return view;
}

void Engine::Impl::Release(size_t chunk, TrainerStream stream) {
  if (chunk >= chunks_.size()) return;
  residency_.Release(chunk, stream);
  pipeline_.Released(chunk);
}

Status Engine::Impl::GradsReady(size_t chunk, TrainerStream stream) {
  if (chunk >= chunks_.size()) {
    return InvalidArgument("chunk " + std::to_string(chunk) + " does not exist");
  }
  if (chunks_[chunk].frozen()) {
    return FailedPrecondition("GradsReady(" + std::to_string(chunk) +
                              "): the chunk holds frozen parameters, which take no gradients");
  }
  return pipeline_.GradsReady(chunk, stream);
}

// ---- Engine: forwarding ----

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options, Device& device,
                                               std::span<const ParameterSpec> parameters,
                                               EngineEnvironment environment) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (environment.ranks_on_node < 0) {
    return InvalidArgument("EngineEnvironment::ranks_on_node must be >= 0 (0 = the launcher's)");
  }
  if (environment.ranks_on_node == 0) {
    STRATA_ASSIGN_OR_RETURN(RankInfo ranks, DetectRanks());
    environment.ranks_on_node = ranks.local_size;
    if (ranks.local_size > 1) {
      Log(LogLevel::kInfo, std::to_string(ranks.local_size) + " ranks on this node (" +
                               ranks.launcher +
                               "): the automatic host budget and optimizer threads are shared");
    }
  }
  const int world_size = environment.communicator ? environment.communicator->size() : 1;
  STRATA_ASSIGN_OR_RETURN(ChunkLayout layout,
                          ChunkLayout::Build(parameters, options.precision.working_dtype,
                                             options.placement.chunk_bytes, world_size));
  auto impl = std::make_unique<Impl>(options, device, std::move(layout), std::move(environment));
  STRATA_RETURN_IF_ERROR(impl->Initialize(parameters));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

const ChunkLayout& Engine::layout() const { return impl_->layout(); }
const ChunkPlacement& Engine::placement(size_t chunk) const {
  return impl_->chunks()[chunk].placement;
}
DType Engine::working_dtype() const { return impl_->working_dtype(); }
Device& Engine::device() const { return impl_->device(); }
Result<ChunkView> Engine::Acquire(size_t chunk) { return impl_->Acquire(chunk); }
void Engine::Release(size_t chunk, TrainerStream stream) { impl_->Release(chunk, stream); }
Status Engine::GradsReady(size_t chunk, TrainerStream stream) {
  return impl_->GradsReady(chunk, stream);
}
std::future<Result<StepReport>> Engine::Step() {
  impl_->param_gather().Discard();  // Stage 3: gathers made ahead hold this step's parameters.
  return impl_->pipeline().Step();
}
Status Engine::AbandonStep() {
  impl_->param_gather().Discard();
  return impl_->pipeline().AbandonStep();
}
double Engine::loss_scale() const { return impl_->pipeline().loss_scale(); }
int64_t Engine::step_count() const { return impl_->pipeline().step_count(); }
int64_t Engine::iteration_count() const { return impl_->pipeline().iteration_count(); }
void Engine::SetLearningRate(double lr) { impl_->pipeline().SetLearningRate(lr); }
Status Engine::SetStepCount(int64_t steps) { return impl_->SetStepCount(steps); }
Status Engine::Save(const std::filesystem::path& dir, const SaveOptions& save_options) {
  return impl_->Save(dir, save_options);
}
Status Engine::CheckSaveTarget(const std::filesystem::path& dir) const {
  return impl_->CheckSaveTarget(dir);
}
Status Engine::Load(const std::filesystem::path& dir) { return impl_->Load(dir); }
Status Engine::ReadMasterParameter(size_t parameter, std::span<float> out) {
  return ReadParameterState(parameter, ParameterState::kMaster, out);
}
Status Engine::ReadParameterState(size_t parameter, ParameterState state, std::span<float> out) {
  const ParameterStateRead read{.parameter = parameter, .state = state, .out = out};
  return impl_->ReadParameterStates({&read, 1});
}
Status Engine::WriteParameterState(size_t parameter, ParameterState state,
                                   std::span<const float> values) {
  const ParameterStateWrite write{.parameter = parameter, .state = state, .values = values};
  return impl_->WriteParameterStates({&write, 1});
}
Status Engine::ReadParameterStates(std::span<const ParameterStateRead> reads) {
  return impl_->ReadParameterStates(reads);
}
Status Engine::WriteParameterStates(std::span<const ParameterStateWrite> writes) {
  return impl_->WriteParameterStates(writes);
}

TierUsage Engine::tier_usage(Tier tier) const {
  return impl_->tier_usage(tier);
}

EngineCounters& EngineCounters::operator+=(const EngineCounters& o) {
  ForEachField([&](const char*, auto member) { this->*member += o.*member; });
  return *this;
}

EngineCounters& EngineCounters::operator-=(const EngineCounters& o) {
  ForEachField([&](const char*, auto member) { this->*member -= o.*member; });
  return *this;
}

EngineCounters Engine::counters() const {
  const auto& m = impl_->metrics();
  auto count = [](const Counter* c) { return static_cast<uint64_t>(c->Value()); };
  return {.device_to_host_bytes = count(m.d2h_bytes),
          .host_to_device_bytes = count(m.h2d_bytes),
          .nvme_read_bytes = count(m.nvme_read_bytes),
          .nvme_write_bytes = count(m.nvme_write_bytes),
          .optimizer_seconds = m.optimizer_seconds->Value(),
          .optimizer_params = count(m.optimizer_params),
          .device_optimizer_params = count(m.device_optimizer_params),
          .evictions = count(m.evictions),
          .fetches = count(m.fetches),
          .fetched_from_host_bytes = count(m.fetched_bytes[0]),
          .fetched_from_nvme_bytes = count(m.fetched_bytes[1]),
          .fetch_stall_seconds = [&m] {
            double seconds = 0.0;
            for (TrainerWait wait : {TrainerWait::kHostToDevice, TrainerWait::kNvme,
                                     TrainerWait::kDeviceToHost, TrainerWait::kDeviceMemory}) {
              seconds += m.trainer_stall[int(wait)]->Value();
            }
            return seconds;
          }(),
          .speculative_updates = count(m.speculative_updates),
          .rolled_back_updates = count(m.rolled_back_updates),
          .reduce_scatter_bytes = count(m.collective_bytes[int(CollectiveKind::kReduceScatter)]),
          .all_gather_bytes = count(m.collective_bytes[int(CollectiveKind::kAllGather)])};
}

MetricsRegistry& Engine::metrics() {
  impl_->UpdateTierGauges();
  return impl_->metrics_registry();
}

TierUsage Engine::Impl::tier_usage(Tier tier) const {
  switch (tier) {
    case Tier::kDevice: return device_budget_.usage();
    case Tier::kHost: return host_budget_.usage();
    case Tier::kNvme: return nvme_budget_.usage();
  }
  return {};
}

void Engine::Impl::UpdateTierGauges() {
  const TierBudget* budgets[kTierCount] = {&device_budget_, &host_budget_, &nvme_budget_};
  for (int t = 0; t < kTierCount; ++t) {
    const TierUsage u = budgets[t]->usage();
    m_.used_bytes[t]->Set(double(u.used_bytes));
    m_.budget_bytes[t]->Set(double(u.budget_bytes));
  }
}

}  // namespace strata::offload
