// Any bytes as a config file, read in each format through the reader every command uses
// (LoadConfigFile): a clear error or options, never a crash, a hang or an exception. Before the
// first input, the reader must refuse what would make it read without bound (/dev/zero, a file
// past the size limit) at once; scripts/fuzz.sh runs this fuzzer with a malloc limit far below
// such a read, so reading one would fail the run. Found crashes become tests in
// tests/core/config_test.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "strata/core/config.h"
#include "strata/core/input_file.h"

namespace {

const std::string& ConfigPath() {
  static const std::string path = (std::filesystem::temp_directory_path() /
                                   ("strata-config-fuzz-" + std::to_string(getpid()) + ".json"))
                                      .string();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (strata::LoadConfigFile("/dev/zero").ok()) __builtin_trap();
  // A sparse file of 1 GiB: no disk used, but an unbounded reader would allocate all of it.
  const std::string huge = ConfigPath() + ".huge";
  const int fd = ::open(huge.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || ::ftruncate(fd, off_t{1} << 30) != 0) __builtin_trap();
  ::close(fd);
  const strata::Result<strata::LoadedConfig> refused = strata::LoadConfigFile(huge);
  ::unlink(huge.c_str());
  if (refused.ok() || refused.status().message().find("larger than") == std::string::npos) {
    __builtin_trap();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(ConfigPath(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  for (strata::ConfigFormat format : {strata::ConfigFormat::kAuto, strata::ConfigFormat::kStrata,
                                      strata::ConfigFormat::kDeepSpeed}) {
    strata::Result<strata::LoadedConfig> loaded = strata::LoadConfigFile(ConfigPath(), format, 2);
    if (loaded.ok()) {
      // What a valid config resolves to reads back as the same options.
      strata::Result<strata::LoadedConfig> again =
          strata::ParseConfig(strata::OptionsToJson(loaded->options));
      if (!again.ok() || !(again->options == loaded->options)) __builtin_trap();
    }
  }
  return 0;
}
