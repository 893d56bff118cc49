// The delayed parameter update (optimizer.delayed_update; docs/architecture.md, "A step"): a
// delayed step's new parameters wait in Chunk::delayed_params until the next step is done with the
// device's, and go up at the chunk's Release, at the next Step(), or before a checkpoint or a
// state write (FlushDelayedParameters).
#include "step/chunk_step.h"
#include "step/step_engine.h"
#include "step/step_pipeline.h"

namespace strata::offload {

Status StepPipeline::UploadDelayedLocked(size_t chunk) {
  StepEngine& e = engine_;
  Chunk& c = e.chunks()[chunk];
  ChunkStep& s = steps_[chunk];
  if (!s.params_delayed) return Status();
  STRATA_ASSIGN_OR_RETURN(const bool released,
                          e.residency().OrderAfterTrainerUse(chunk, Stream::kHostToDevice));
  if (!released) return Status();  // Its Release, or the next Step(), sends them.
  const size_t wbytes = c.working_bytes(e.working_size());
  STRATA_RETURN_IF_ERROR(e.device().CopyToDevice(c.params.data(), c.delayed_params.data(), wbytes));
  e.metrics().h2d_bytes->Increment(double(wbytes));
  s.params_delayed = false;
  return Status();
}

Status StepPipeline::FlushDelayedParameters() {
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < engine_.chunks().size(); ++i) {
      STRATA_RETURN_IF_ERROR(UploadDelayedLocked(i));
      if (steps_[i].params_delayed) {
        return FailedPrecondition("chunk " + std::to_string(i) +
                                  " is acquired; Release every chunk first");
      }
    }
  }
  return engine_.device().SynchronizeStream(Stream::kHostToDevice);
}

}  // namespace strata::offload
