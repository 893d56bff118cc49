// Any bytes as a config file, read in each format: a clear error or options, never a crash, a
// hang or an exception. Found crashes become tests in tests/core/config_test.cpp.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (strata::ConfigFormat format : {strata::ConfigFormat::kAuto, strata::ConfigFormat::kStrata,
                                      strata::ConfigFormat::kDeepSpeed}) {
    strata::Result<strata::LoadedConfig> loaded = strata::ParseConfig(text, format, "fuzz", 2);
    if (loaded.ok()) {
      // What a valid config resolves to reads back as the same options.
      strata::Result<strata::LoadedConfig> again =
          strata::ParseConfig(strata::OptionsToJson(loaded->options));
      if (!again.ok() || !(again->options == loaded->options)) __builtin_trap();
    }
  }
  return 0;
}
