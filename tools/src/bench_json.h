// Each library benchmark's result as the JSON document its `strata bench <name> --json`
// prints, so that `strata bench all` writes the same fields.
#pragma once

#include <nlohmann/json.hpp>

#include "strata/cpu_adam/adam_benchmark.h"
#include "strata/offload/pipeline_benchmark.h"

namespace strata::tools {

/// bench_adam_command.cpp.
nlohmann::ordered_json ToJson(const cpu_adam::AdamBenchmarkOptions& options,
                              const cpu_adam::AdamBenchmarkResult& result);

/// bench_pipeline_command.cpp.
nlohmann::ordered_json ToJson(const offload::PipelineBenchmarkOptions& options,
                              const offload::PipelineBenchmarkResult& result);

}  // namespace strata::tools
