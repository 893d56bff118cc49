#include "checkpoint/checkpoint_files.h"
#include "checkpoint/checkpoint_ownership.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/log.h"
#include "support/sanitizers.h"
#include "support/scratch_dir.h"

namespace strata::offload::internal {
namespace {

using strata::testing::kUnderThreadSanitizer;
using strata::testing::ScratchDir;

namespace fs = std::filesystem;

/// Deterministic, position-dependent bytes, different per `seed`.
std::vector<std::byte> Pattern(size_t size, uint32_t seed) {
  std::vector<std::byte> bytes(size);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : bytes) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return bytes;
}

FileDigest DigestOf(const std::vector<std::byte>& bytes) {
  return {bytes.size(), XXH3_64bits(bytes.data(), bytes.size())};
}

/// The entries of `dir`, sorted, but for the staging marker every checkpoint holds (its own
/// tests check it).
std::vector<std::string> List(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename() == kStagingMarkerName) continue;
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/// Writes `files` (name -> content) as one checkpoint at `dir`, each in appends of `step` bytes.
/// Returns their digests in a manifest under "files".
nlohmann::json WriteCheckpoint(
    const fs::path& dir, const std::vector<std::pair<std::string, std::vector<std::byte>>>& files,
    size_t step = 4093) {
  auto writer = CheckpointWriter::Begin(dir);
  EXPECT_TRUE(writer.ok()) << writer.status().ToString();
  if (!writer.ok()) return {};
  nlohmann::json manifest = NewManifest();
  for (const auto& [name, content] : files) {
    auto sink = writer->CreateFile(name);
    EXPECT_TRUE(sink.ok()) << sink.status().ToString();
    if (!sink.ok()) return {};
    for (size_t at = 0; at < content.size(); at += step) {
      const size_t n = std::min(step, content.size() - at);
      EXPECT_TRUE(sink->Append(std::span(content).subspan(at, n)).ok());
    }
    auto digest = sink->Finish();
    EXPECT_TRUE(digest.ok()) << digest.status().ToString();
    if (!digest.ok()) return {};
    manifest["files"][name] = {{"bytes", digest->bytes}, {"xxh3", digest->xxh3}};
  }
  const Status status = writer->Commit(manifest);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return manifest;
}

/// Reads `name` whole through ReadFile; returns its status and fills `out`.
Status ReadAll(const CheckpointReader& reader, const std::string& name, const FileDigest& expected,
               std::vector<std::byte>* out, size_t piece_bytes = 8 << 20) {
  out->assign(expected.bytes, std::byte{0});
  return reader.ReadFile(
      name, expected,
      [&](std::span<const std::byte> piece, uint64_t offset) {
        EXPECT_LE(offset + piece.size(), out->size());
        std::copy(piece.begin(), piece.end(), out->begin() + static_cast<ptrdiff_t>(offset));
        return Status::Ok();
      },
      piece_bytes);
}

bool Contains(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

// The other ranks of a sharded save join the first rank's staging directory: their files land
// in the one checkpoint the first rank commits, they cannot commit it themselves, and dropping a
// joined writer leaves the directory to its owner.
TEST(CheckpointFilesTest, JoinedWritersAddFilesToTheCheckpointTheFirstOneCommits) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "step-7";
  auto owner = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(owner.ok()) << owner.status().ToString();
  EXPECT_EQ(owner->staging_pid(), getpid());
  nlohmann::json manifest = NewManifest();
  {
    auto joined = CheckpointWriter::Join(tmp.path() / "step-7/", owner->staging_pid());
    ASSERT_TRUE(joined.ok()) << joined.status().ToString();
    EXPECT_EQ(joined->staging_dir(), owner->staging_dir());
    auto sink = joined->CreateFile("rank-1.bin");
    ASSERT_TRUE(sink.ok()) << sink.status().ToString();
    ASSERT_TRUE(sink->Append(Pattern(5000, 9)).ok());
    auto digest = sink->Finish();
    ASSERT_TRUE(digest.ok());
    manifest["files"]["rank-1.bin"] = {{"bytes", digest->bytes}, {"xxh3", digest->xxh3}};
    const Status refused = joined->Commit(manifest);
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Contains(refused, "the writer that began it commits")) << refused.message();
  }
  ASSERT_TRUE(fs::is_directory(owner->staging_dir())) << "the joined writer removed it";
  auto sink = owner->CreateFile("rank-0.bin");
  ASSERT_TRUE(sink.ok());
  ASSERT_TRUE(sink->Append(Pattern(3000, 8)).ok());
  ASSERT_TRUE(sink->Finish().ok());
  // Before committing, the owner checks the joined writers' files are where it commits.
  const std::pair<std::string, uint64_t> present[] = {{"rank-1.bin", 5000}};
  EXPECT_TRUE(owner->CheckFilesPresent(present).ok());
  const std::pair<std::string, uint64_t> short_file[] = {{"rank-1.bin", 5001}};
  const Status wrong_size = owner->CheckFilesPresent(short_file);
  EXPECT_EQ(wrong_size.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(wrong_size, "holds 5000 bytes")) << wrong_size.message();
  const std::pair<std::string, uint64_t> absent[] = {{"rank-2.bin", 10}};
  const Status missing = owner->CheckFilesPresent(absent);
  EXPECT_EQ(missing.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(missing, "rank-2.bin, which another rank wrote, is not in"))
      << missing.message();
  ASSERT_TRUE(owner->Commit(manifest).ok());
  EXPECT_TRUE(fs::exists(dir / "rank-0.bin"));
  EXPECT_TRUE(fs::exists(dir / "rank-1.bin"));

  // A staging directory this rank cannot see: not a file system the ranks share.
  auto lost = CheckpointWriter::Join(tmp.path() / "step-8", getpid());
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(lost.status(), "a file system every rank shares"))
      << lost.status().message();
}

TEST(CheckpointFilesTest, RoundTripsStreamedFilesAndManifest) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "step-100";
  const auto a = Pattern(100000, 1);
  const auto b = Pattern(1, 2);
  const auto c = Pattern(0, 3);

  auto writer = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ(writer->dir(), dir);
  EXPECT_EQ(writer->staging_dir(), tmp.path() / ("step-100.tmp-" + std::to_string(getpid())));
  EXPECT_TRUE(fs::is_directory(writer->staging_dir()));
  EXPECT_FALSE(fs::exists(dir));

  nlohmann::json manifest = NewManifest();
  EXPECT_EQ(manifest, nlohmann::json({{"format", "strata-checkpoint"}, {"version", 2}}));
  {
    auto sink = writer->CreateFile("chunk-000000.bin");
    ASSERT_TRUE(sink.ok()) << sink.status().ToString();
    EXPECT_EQ(sink->path(), writer->staging_dir() / "chunk-000000.bin");
    // Odd sizes: 1, 7, 4093, 65537, 0 and the rest.
    size_t at = 0;
    for (size_t n : {size_t{1}, size_t{7}, size_t{4093}, size_t{65537}, size_t{0}}) {
      ASSERT_TRUE(sink->Append(std::span(a).subspan(at, n)).ok());
      at += n;
    }
    ASSERT_TRUE(sink->Append(std::span(a).subspan(at)).ok());
    EXPECT_EQ(sink->bytes_written(), a.size());
    auto digest = sink->Finish();
    ASSERT_TRUE(digest.ok()) << digest.status().ToString();
    EXPECT_EQ(*digest, DigestOf(a));
    auto on_disk = DigestFile(writer->staging_dir() / "chunk-000000.bin");
    ASSERT_TRUE(on_disk.ok()) << on_disk.status().ToString();
    EXPECT_EQ(*on_disk, DigestOf(a));
    manifest["chunks"]["a"] = {{"bytes", digest->bytes}, {"xxh3", digest->xxh3}};
  }
  for (const auto& [name, content] :
       {std::pair{std::string("b.bin"), b}, std::pair{std::string("c.bin"), c}}) {
    auto sink = writer->CreateFile(name);
    ASSERT_TRUE(sink.ok()) << sink.status().ToString();
    ASSERT_TRUE(sink->Append(content).ok());
    auto digest = sink->Finish();
    ASSERT_TRUE(digest.ok());
    EXPECT_EQ(*digest, DigestOf(content)) << name;
  }
  manifest["step"] = 100;
  ASSERT_TRUE(writer->Commit(manifest).ok());

  EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"step-100"});
  EXPECT_EQ(List(dir),
            (std::vector<std::string>{"b.bin", "c.bin", "chunk-000000.bin", "manifest.json"}));
  // The manifest as given, with the files the checkpoint holds and its checksum.
  nlohmann::json sealed = manifest;
  sealed["contents"] = {std::string(kStagingMarkerName), "b.bin", "c.bin", "chunk-000000.bin"};
  sealed["checksum"] = ManifestChecksum(sealed);
  EXPECT_EQ(ReadText(dir / "manifest.json"), sealed.dump(2) + "\n");
  EXPECT_NE(ReadText(dir / "manifest.json").find("\n  \"format\": \"strata-checkpoint\""),
            std::string::npos);

  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest(), manifest);
  EXPECT_EQ(reader->manifest()["step"], 100);

  // Pieces of 1000 bytes, in order, contiguous; the last one shorter.
  std::vector<std::byte> out(a.size());
  std::vector<std::pair<uint64_t, size_t>> pieces;
  const Status status = reader->ReadFile(
      "chunk-000000.bin", DigestOf(a),
      [&](std::span<const std::byte> piece, uint64_t offset) {
        pieces.emplace_back(offset, piece.size());
        std::copy(piece.begin(), piece.end(), out.begin() + static_cast<ptrdiff_t>(offset));
        return Status::Ok();
      },
      1000);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(out, a);
  ASSERT_EQ(pieces.size(), 100u);
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].first, i * 1000);
    EXPECT_EQ(pieces[i].second, 1000u);
  }

  std::vector<std::byte> small;
  ASSERT_TRUE(ReadAll(*reader, "b.bin", DigestOf(b), &small).ok());
  EXPECT_EQ(small, b);
  int calls = 0;
  ASSERT_TRUE(reader
                  ->ReadFile("c.bin", DigestOf(c),
                             [&](std::span<const std::byte>, uint64_t) {
                               ++calls;
                               return Status::Ok();
                             })
                  .ok());
  EXPECT_EQ(calls, 0) << "an empty file has no pieces";
}

TEST(CheckpointFilesTest, ReadFileStopsAtConsumerError) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(5000, 4);
  WriteCheckpoint(dir, {{"x.bin", data}});
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  int calls = 0;
  const Status status = reader->ReadFile(
      "x.bin", DigestOf(data),
      [&](std::span<const std::byte>, uint64_t) {
        ++calls;
        return ResourceExhausted("no room");
      },
      1024);
  EXPECT_EQ(status, ResourceExhausted("no room"));
  EXPECT_EQ(calls, 1);
}

TEST(CheckpointFilesTest, ReadFileDetectsFlippedByte) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(3000, 5);
  WriteCheckpoint(dir, {{"chunk-000003.bin", data}});
  {
    std::fstream f(dir / "chunk-000003.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1234);
    f.put(static_cast<char>(static_cast<unsigned char>(data[1234]) ^ 0x10));
  }
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out;
  const FileDigest expected = DigestOf(data);
  const Status status = ReadAll(*reader, "chunk-000003.bin", expected, &out, 1024);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.ToString();
  EXPECT_TRUE(Contains(status, "chunk-000003.bin")) << status.message();
  EXPECT_TRUE(Contains(status, "3000 bytes")) << status.message();
  char hex[24];
  std::snprintf(hex, sizeof(hex), "0x%016llx", static_cast<unsigned long long>(expected.xxh3));
  EXPECT_TRUE(Contains(status, hex)) << status.message();
  auto actual = DigestFile(dir / "chunk-000003.bin");
  ASSERT_TRUE(actual.ok());
  std::snprintf(hex, sizeof(hex), "0x%016llx", static_cast<unsigned long long>(actual->xxh3));
  EXPECT_TRUE(Contains(status, hex)) << status.message();
  // The consumer saw the bad bytes before the mismatch was known: callers discard on error.
  EXPECT_NE(out, data);
  EXPECT_EQ(static_cast<unsigned>(out[1234]), static_cast<unsigned>(data[1234]) ^ 0x10);
}

TEST(CheckpointFilesTest, ReadFileDetectsTruncatedFile) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(3000, 6);
  WriteCheckpoint(dir, {{"t.bin", data}});
  fs::resize_file(dir / "t.bin", 2999);
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  int calls = 0;
  const Status status =
      reader->ReadFile("t.bin", DigestOf(data), [&](std::span<const std::byte>, uint64_t) {
        ++calls;
        return Status::Ok();
      });
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(status, "t.bin")) << status.message();
  EXPECT_TRUE(Contains(status, "truncated")) << status.message();
  EXPECT_TRUE(Contains(status, "2999 bytes")) << status.message();
  EXPECT_TRUE(Contains(status, "3000 bytes")) << status.message();
  EXPECT_EQ(calls, 0) << "a size mismatch is caught before any piece is consumed";
}

TEST(CheckpointFilesTest, ReadFileDetectsExtraByte) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(3000, 7);
  WriteCheckpoint(dir, {{"e.bin", data}});
  std::ofstream(dir / "e.bin", std::ios::binary | std::ios::app).put('x');
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out;
  const Status status = ReadAll(*reader, "e.bin", DigestOf(data), &out);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(status, "e.bin")) << status.message();
  EXPECT_TRUE(Contains(status, "longer")) << status.message();
  EXPECT_TRUE(Contains(status, "3001 bytes")) << status.message();
}

TEST(CheckpointFilesTest, ReadFileReportsMissingFile) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"present.bin", Pattern(10, 8)}});
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out;
  const Status status = ReadAll(*reader, "absent.bin", FileDigest{10, 0}, &out);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(status, "incomplete")) << status.message();
  EXPECT_TRUE(Contains(status, "file absent.bin is missing")) << status.message();

  const Status bad_name = ReadAll(*reader, "../present.bin", FileDigest{10, 0}, &out);
  EXPECT_EQ(bad_name.code(), StatusCode::kInvalidArgument);
  const Status zero_piece = reader->ReadFile(
      "present.bin", FileDigest{10, 0},
      [](std::span<const std::byte>, uint64_t) { return Status::Ok(); }, 0);
  EXPECT_EQ(zero_piece.code(), StatusCode::kInvalidArgument);
}

TEST(CheckpointFilesTest, OpenMissingDirectoryIsNotFound) {
  ScratchDir tmp;
  auto reader = CheckpointReader::Open(tmp.path() / "nothing-here");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(reader.status(), "nothing-here")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "not a Strata checkpoint")) << reader.status().message();
}

TEST(CheckpointFilesTest, OpenDirectoryWithoutManifestIsNotFound) {
  ScratchDir tmp;
  fs::create_directory(tmp.path() / "plain");
  WriteText(tmp.path() / "plain" / "data.bin", "abc");
  auto reader = CheckpointReader::Open(tmp.path() / "plain");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(reader.status(), "not a Strata checkpoint")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "manifest.json is missing")) << reader.status().message();
}

TEST(CheckpointFilesTest, OpenMalformedManifestIsDataLoss) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  fs::create_directory(dir);
  WriteText(dir / "manifest.json", "{\"format\": \"strata-checkpoint\", \"version\": 1,");
  auto reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(reader.status(), "malformed JSON")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "syntax error")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "manifest.json")) << reader.status().message();

  WriteText(dir / "manifest.json", "[1, 2]");
  reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(reader.status(), "JSON object")) << reader.status().message();
}

// A number beyond a double is damage too (nlohmann reports it as out_of_range, not a parse
// error): found by the manifest fuzzer.
TEST(CheckpointFilesTest, OpenCallsANumberBeyondADoubleDamage) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  fs::create_directory(dir);
  WriteText(dir / "manifest.json", R"({"format": "strata-checkpoint", "version": 1, "x": 1e400})");
  auto reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss) << reader.status().ToString();
  EXPECT_TRUE(Contains(reader.status(), "malformed JSON")) << reader.status().message();
}

TEST(CheckpointFilesTest, OpenRejectsWrongFormatAndVersion) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  fs::create_directory(dir);

  WriteText(dir / "manifest.json", R"({"format": "deepspeed", "version": 1})");
  auto reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(reader.status(), "\"deepspeed\"")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "strata-checkpoint")) << reader.status().message();

  WriteText(dir / "manifest.json", R"({"version": 1})");
  reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(reader.status(), "\"format\" is missing")) << reader.status().message();

  WriteText(dir / "manifest.json", R"({"format": "strata-checkpoint", "version": 3})");
  reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(reader.status(), "format version 3")) << reader.status().message();
  EXPECT_TRUE(Contains(reader.status(), "reads versions 1 to 2")) << reader.status().message();

  for (const char* version : {R"("1")", "1.5", "0", "-3"}) {
    WriteText(dir / "manifest.json",
              std::string(R"({"format": "strata-checkpoint", "version": )") + version + "}");
    reader = CheckpointReader::Open(dir);
    ASSERT_FALSE(reader.ok()) << version;
    EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument) << version;
  }

  nlohmann::json sealed = {{"format", "strata-checkpoint"}, {"version", 1}, {"x", 5}};
  sealed["checksum"] = ManifestChecksum(sealed);
  WriteText(dir / "manifest.json", sealed.dump());
  reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest()["x"], 5);
  EXPECT_EQ(reader->dir(), dir);
}

TEST(CheckpointFilesTest, CommitRejectsManifestWithoutHeader) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  auto writer = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(writer.ok());
  Status status = writer->Commit(nlohmann::json{{"step", 1}});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "NewManifest()")) << status.message();
  status = writer->Commit(nlohmann::json{{"format", "strata-checkpoint"}});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(status, "\"version\"")) << status.message();
  nlohmann::json bad_utf8 = NewManifest();
  bad_utf8["name"] = std::string("\xff\xfe");
  status = writer->Commit(bad_utf8);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_FALSE(fs::exists(dir));
  // The writer is still usable after a rejected manifest.
  ASSERT_TRUE(writer->Commit(NewManifest()).ok());
  EXPECT_EQ(List(dir), std::vector<std::string>{"manifest.json"});
  EXPECT_EQ(writer->Commit(NewManifest()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(writer->CreateFile("late.bin").status().code(), StatusCode::kFailedPrecondition);
}

TEST(CheckpointFilesTest, CommitReplacesExistingCheckpoint) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto old_data = Pattern(5000, 9);
  const auto new_data = Pattern(7000, 10);
  nlohmann::json first = WriteCheckpoint(dir, {{"old.bin", old_data}, {"shared.bin", old_data}});
  ASSERT_EQ(List(dir), (std::vector<std::string>{"manifest.json", "old.bin", "shared.bin"}));

  nlohmann::json second = WriteCheckpoint(dir, {{"new.bin", new_data}, {"shared.bin", new_data}});
  EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"ckpt"}) << "no staging or old dirs left";
  EXPECT_EQ(List(dir), (std::vector<std::string>{"manifest.json", "new.bin", "shared.bin"}));

  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->manifest(), second);
  EXPECT_NE(reader->manifest(), first);
  std::vector<std::byte> out;
  ASSERT_TRUE(ReadAll(*reader, "shared.bin", DigestOf(new_data), &out).ok());
  EXPECT_EQ(out, new_data);
}

// A sharded save commits keeping the previous checkpoint until its ranks agree: the new one
// is in place at once, the old one waits beside it for RemovePrevious (or the destructor).
TEST(CheckpointFilesTest, CommitCanLeaveThePreviousCheckpointForLater) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"old.bin", Pattern(3000, 13)}});
  for (const bool explicitly : {true, false}) {
    SCOPED_TRACE(explicitly ? "RemovePrevious" : "destructor");
    {
      auto writer = CheckpointWriter::Begin(dir);
      ASSERT_TRUE(writer.ok());
      auto sink = writer->CreateFile("new.bin");
      ASSERT_TRUE(sink.ok());
      ASSERT_TRUE(sink->Append(Pattern(4000, 14)).ok());
      ASSERT_TRUE(sink->Finish().ok());
      ASSERT_TRUE(writer->Commit(NewManifest(), /*keep_previous=*/true).ok());
      EXPECT_EQ(List(dir), (std::vector<std::string>{"manifest.json", "new.bin"}));
      EXPECT_EQ(List(tmp.path()).size(), 2u) << "the previous checkpoint waits beside it";
      if (explicitly) {
        writer->RemovePrevious();
        EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"ckpt"});
      }
    }
    EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"ckpt"});
    EXPECT_TRUE(CheckpointReader::Open(dir).ok());
  }
}

TEST(CheckpointFilesTest, AbandonedWriterKeepsPreviousCheckpoint) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(2048, 11);
  const nlohmann::json manifest = WriteCheckpoint(dir, {{"a.bin", data}});
  fs::path staging;
  {
    auto writer = CheckpointWriter::Begin(dir);
    ASSERT_TRUE(writer.ok());
    staging = writer->staging_dir();
    auto sink = writer->CreateFile("a.bin");
    ASSERT_TRUE(sink.ok());
    ASSERT_TRUE(sink->Append(Pattern(100, 12)).ok());
    ASSERT_TRUE(sink->Finish().ok());
    EXPECT_TRUE(fs::exists(staging / "a.bin"));
    // Destroyed without Commit, as when a save fails half-way.
  }
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"ckpt"});
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->manifest(), manifest);
  std::vector<std::byte> out;
  ASSERT_TRUE(ReadAll(*reader, "a.bin", DigestOf(data), &out).ok());
  EXPECT_EQ(out, data);
}

TEST(CheckpointFilesTest, CommitRefusesOpenOrAbandonedFiles) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  auto writer = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(writer.ok());
  {
    auto sink = writer->CreateFile("open.bin");
    ASSERT_TRUE(sink.ok());
    ASSERT_TRUE(sink->Append(Pattern(10, 13)).ok());
    const Status status = writer->Commit(NewManifest());
    EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Contains(status, "1 of its files are still open")) << status.message();
  }  // Destroyed without Finish.
  const Status status = writer->Commit(NewManifest());
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(status, "not durable")) << status.message();
  EXPECT_FALSE(fs::exists(dir));
}

TEST(CheckpointFilesTest, SinkRejectsUseAfterFinish) {
  ScratchDir tmp;
  auto writer = CheckpointWriter::Begin(tmp.path() / "ckpt");
  ASSERT_TRUE(writer.ok());
  auto sink = writer->CreateFile("f.bin");
  ASSERT_TRUE(sink.ok());
  ASSERT_TRUE(sink->Append(Pattern(3, 14)).ok());
  CheckpointFileSink moved = std::move(*sink);
  EXPECT_EQ(sink->Append(Pattern(3, 14)).code(), StatusCode::kFailedPrecondition);
  auto digest = moved.Finish();
  ASSERT_TRUE(digest.ok());
  EXPECT_EQ(digest->bytes, 3u);
  EXPECT_EQ(moved.Append(Pattern(1, 15)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(moved.Finish().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(writer->Commit(NewManifest()).ok());
}

TEST(CheckpointFilesTest, BeginRemovesLeftoversOfDeadProcesses) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(500, 16);
  const nlohmann::json manifest = WriteCheckpoint(dir, {{"a.bin", data}});

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // `child` is now a dead pid.

  // Staging directories carry the marker Begin writes into each.
  const fs::path dead_staging = tmp.path() / ("ckpt.tmp-" + std::to_string(child));
  fs::create_directory(dead_staging);
  WriteText(dead_staging / std::string(kStagingMarkerName), "");
  WriteText(dead_staging / "chunk-000000.bin", "partial");
  const fs::path own_stale = tmp.path() / ("ckpt.tmp-" + std::to_string(getpid()));
  fs::create_directory(own_stale);
  WriteText(own_stale / std::string(kStagingMarkerName), "");
  WriteText(own_stale / "junk.bin", "junk");
  // A live process's staging dir (pid 1 always exists), another checkpoint's and a non-pid
  // suffix are left alone.
  const fs::path live = tmp.path() / "ckpt.tmp-1";
  const fs::path other = tmp.path() / ("other.tmp-" + std::to_string(child));
  const fs::path not_pid = tmp.path() / "ckpt.tmp-12abc";
  for (const auto& path : {live, other, not_pid}) fs::create_directory(path);

  std::vector<std::string> warnings;
  SetLogSink([&](LogLevel level, std::string_view message) {
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  auto writer = CheckpointWriter::Begin(dir);
  SetLogSink(nullptr);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_FALSE(fs::exists(dead_staging));
  EXPECT_TRUE(std::any_of(warnings.begin(), warnings.end(), [&](const std::string& w) {
    return w == "removed " + dead_staging.string() + ", left by an interrupted checkpoint save";
  })) << ::testing::PrintToString(warnings);
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(not_pid));
  EXPECT_EQ(writer->staging_dir(), own_stale);
  EXPECT_TRUE(fs::is_directory(own_stale));
  EXPECT_TRUE(List(own_stale).empty()) << "the stale staging dir of the same name is recreated";
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->manifest(), manifest);
}

TEST(CheckpointFilesTest, BeginRestoresCheckpointLeftInFallbackWindow) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(700, 17);
  const nlohmann::json manifest = WriteCheckpoint(dir, {{"a.bin", data}});
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  // A crash between the fallback's two renames: old checkpoint at ckpt.old-<pid>, nothing at
  // ckpt.
  const fs::path old = tmp.path() / ("ckpt.old-" + std::to_string(child));
  fs::rename(dir, old);
  EXPECT_EQ(CheckpointReader::Open(dir).status().code(), StatusCode::kNotFound);

  auto writer = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_FALSE(fs::exists(old));
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest(), manifest);
}

TEST(CheckpointFilesTest, CreateFileRejectsBadNames) {
  ScratchDir tmp;
  auto writer = CheckpointWriter::Begin(tmp.path() / "ckpt");
  ASSERT_TRUE(writer.ok());
  for (const char* name : {"a/b.bin", "/abs.bin", "../up.bin", "", ".", "..", "manifest.json"}) {
    auto sink = writer->CreateFile(name);
    ASSERT_FALSE(sink.ok()) << name;
    EXPECT_EQ(sink.status().code(), StatusCode::kInvalidArgument) << name;
  }
  EXPECT_TRUE(Contains(writer->CreateFile("a/b.bin").status(), "no '/'"));
  EXPECT_TRUE(List(writer->staging_dir()).empty());

  auto first = writer->CreateFile("dup.bin");
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->Finish().ok());
  auto second = writer->CreateFile("dup.bin");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(Contains(second.status(), "dup.bin")) << second.status().message();
}

TEST(CheckpointFilesTest, BeginWithMissingParentFails) {
  ScratchDir tmp;
  const fs::path parent = tmp.path() / "no-such-dir";
  auto writer = CheckpointWriter::Begin(parent / "ckpt");
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(writer.status(), "parent directory " + parent.string() + " does not exist"))
      << writer.status().message();
  EXPECT_TRUE(Contains(writer.status(), "No such file or directory")) << writer.status().message();
  EXPECT_TRUE(fs::is_empty(tmp.path()));
}

TEST(CheckpointFilesTest, BeginRefusesACheckpointThatCannotFitAndKeepsThePreviousOne) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"a.bin", Pattern(100, 1)}});
  // More than any file system here has free.
  const uint64_t needed = uint64_t{1} << 60;
  auto writer = CheckpointWriter::Begin(dir, needed);
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(writer.status(), "it needs " + FormatBytes(needed)))
      << writer.status().message();
  EXPECT_TRUE(Contains(writer.status(), "free (a previous checkpoint there stays"))
      << writer.status().message();
  // Nothing written, nothing staged, the previous checkpoint as it was.
  EXPECT_EQ(List(tmp.path()), std::vector<std::string>{"ckpt"});
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  // What fits is let through.
  EXPECT_TRUE(CheckpointWriter::Begin(dir, 4096).ok());
}

TEST(CheckpointFilesTest, UsableBytesFollowWhatTheWriterMayFill) {
  struct statvfs space {};
  space.f_frsize = 4096;
  space.f_blocks = 1000;
  space.f_bfree = 100;  // 50 of them reserved for root, as ext4 does.
  space.f_bavail = 50;
  EXPECT_EQ(UsableBytes(space, /*privileged=*/false), 50u * 4096);
  EXPECT_EQ(UsableBytes(space, /*privileged=*/true), 100u * 4096);
  // No capacity reported (libfuse's default statfs): nothing to check against.
  const struct statvfs no_capacity {};
  EXPECT_EQ(UsableBytes(no_capacity, false), std::nullopt);
  // A near-infinite count saturates instead of wrapping to a small number.
  space.f_bavail = space.f_bfree = space.f_blocks = UINT64_MAX / 2;
  EXPECT_EQ(UsableBytes(space, false), UINT64_MAX);
}

TEST(CheckpointFilesTest, BeginOnFileOrBadPathIsInvalidArgument) {
  ScratchDir tmp;
  WriteText(tmp.path() / "file", "x");
  auto writer = CheckpointWriter::Begin(tmp.path() / "file");
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(writer.status(), "is not a directory")) << writer.status().message();

  writer = CheckpointWriter::Begin(tmp.path() / "file" / "ckpt");
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kInvalidArgument) << writer.status().ToString();
  EXPECT_TRUE(
      Contains(writer.status(), "parent " + (tmp.path() / "file").string() + " is not a directory"))
      << writer.status().message();

  writer = CheckpointWriter::Begin(tmp.path() / "..");
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kInvalidArgument);

  // A trailing slash names the same directory.
  writer = CheckpointWriter::Begin(tmp.path().string() + "/ckpt/");
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  EXPECT_EQ(writer->dir(), tmp.path() / "ckpt");
}

// Strata replaces only what it can prove it wrote: an empty directory or a checkpoint whose
// manifest lists everything in it. Anything else is refused before a byte is written, and left
// exactly as it was.
TEST(CheckpointFilesTest, BeginRefusesADirectoryThatIsNotItsCheckpoint) {
  ScratchDir tmp;
  const fs::path notes = tmp.path() / "notes";
  fs::create_directory(notes);
  WriteText(notes / "a.txt", "draft");
  auto writer = CheckpointWriter::Begin(notes);
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(writer.status(), "not a Strata checkpoint")) << writer.status().message();
  EXPECT_TRUE(Contains(writer.status(), "\"a.txt\"")) << writer.status().message();
  EXPECT_EQ(CheckCheckpointTarget(notes, 0).code(), StatusCode::kFailedPrecondition);
  // Through a symbolic link: the same directory, the same answer.
  fs::create_directory_symlink(notes, tmp.path() / "link");
  EXPECT_EQ(CheckpointWriter::Begin(tmp.path() / "link").status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(List(notes), std::vector<std::string>{"a.txt"});
  EXPECT_EQ(ReadText(notes / "a.txt"), "draft");
  EXPECT_EQ(List(tmp.path()), (std::vector<std::string>{"link", "notes"})) << "nothing staged";

  // A checkpoint with a file of someone else's added to it.
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"a.bin", Pattern(100, 1)}});
  ASSERT_TRUE(CheckReplaceable(dir).ok());
  WriteText(dir / "mine.txt", "keep me");
  const Status refused = CheckpointWriter::Begin(dir).status();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused, "\"mine.txt\", which the checkpoint did not write"))
      << refused.message();
  EXPECT_EQ(ReadText(dir / "mine.txt"), "keep me");
  EXPECT_TRUE(CheckpointReader::Open(dir).ok());

  // An empty directory is taken.
  const fs::path empty = tmp.path() / "empty";
  fs::create_directory(empty);
  EXPECT_TRUE(CheckpointWriter::Begin(empty).ok());
}

// What a checkpoint directory holds when it is replaced is checked again at that moment: a file
// put there during the save survives it.
TEST(CheckpointFilesTest, ThePreviousCheckpointIsRemovedOnlyIfStillOnlyOurs) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"old.bin", Pattern(300, 2)}});
  auto writer = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(writer.ok());
  WriteText(dir / "late.txt", "written during the save");
  std::vector<std::string> warnings;
  SetLogSink([&](LogLevel level, std::string_view message) {
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  ASSERT_TRUE(writer->Commit(NewManifest()).ok());
  SetLogSink(nullptr);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("late.txt"), std::string::npos) << warnings[0];
  // Kept under a name of its own, which no later save or cleanup takes for a leftover.
  std::vector<std::string> names = List(tmp.path());
  ASSERT_EQ(names.size(), 2u) << ::testing::PrintToString(names);
  EXPECT_EQ(names[0], "ckpt");
  EXPECT_EQ(names[1].rfind("ckpt.kept-", 0), 0u) << names[1];
  const fs::path kept = tmp.path() / names[1];
  EXPECT_EQ(ReadText(kept / "late.txt"), "written during the save");
  for (int save = 0; save < 2; ++save) {
    WriteCheckpoint(dir, {{"new.bin", Pattern(30, 3)}});
    EXPECT_EQ(ReadText(kept / "late.txt"), "written during the save");
  }
}

// A leftover whose name is a staging directory's but which lacks Strata's marker is not
// Strata's: Begin leaves it, and so does the restore of a fallback's old checkpoint.
// A writer killed while writing its manifest (kill -9 at random moments, fault_test.py) left a
// truncated manifest.json, which no later save could prove to be Strata's: its staging
// directory stayed for good. Here the writer is a child process that a file-size limit kills
// (SIGXFSZ) in the middle of that write; the next writer must remove what it left.
TEST(CheckpointFilesTest, AWriterKilledWhileWritingItsManifestIsCleanedUpAfter) {
  if (kUnderThreadSanitizer) {
    GTEST_SKIP() << "the child runs the writer after fork(), which TSan does not support";
  }
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  WriteCheckpoint(dir, {{"a.bin", Pattern(10, 3)}});
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto writer = CheckpointWriter::Begin(dir);
    if (!writer.ok()) _exit(2);
    auto sink = writer->CreateFile("a.bin");
    if (!sink.ok() || !sink->Append(Pattern(10, 4)).ok()) _exit(3);
    auto digest = sink->Finish();
    if (!digest.ok()) _exit(4);
    nlohmann::json manifest = NewManifest();
    manifest["files"]["a.bin"] = {{"bytes", digest->bytes}, {"xxh3", digest->xxh3}};
    // Every file written so far is smaller than this; the manifest is not.
    const rlimit limit{.rlim_cur = 64, .rlim_max = 64};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(5);
    (void)writer->Commit(manifest);
    _exit(6);  // Not reached: SIGXFSZ ends the process in the middle of the manifest.
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGXFSZ)
      << "the child ended otherwise: status " << wait_status;
  const fs::path dead = tmp.path() / ("ckpt.tmp-" + std::to_string(child));
  ASSERT_TRUE(fs::exists(dead));
  auto next = CheckpointWriter::Begin(dir);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_FALSE(fs::exists(dead)) << "left: " << ::testing::PrintToString(List(dead));
  EXPECT_TRUE(CheckpointReader::Open(dir).ok()) << "the previous checkpoint stays";
}

// The previous checkpoint, swapped to the staging name by a save, is removed by that save: a
// process killed part way through the removal leaves what the next save must still prove
// Strata's and remove. In directory order the marker could go first, leaving a manifest and
// data files that no cleanup may touch (seen as a leftover under faults_through_the_cli).
TEST(CheckpointFilesTest, ARemovalStoppedAfterAnyFileLeavesWhatTheNextSaveRemoves) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const fs::path model = tmp.path() / "model";
  WriteCheckpoint(model, {{"a.bin", Pattern(10, 1)}, {"b.bin", Pattern(20, 2)},
                          {"z.bin", Pattern(30, 3)}});
  const std::vector<std::string> order = RemovalOrder(model);
  ASSERT_EQ(order.size(), 5u) << ::testing::PrintToString(order);
  EXPECT_EQ(order[3], std::string(kManifestFileName));
  EXPECT_EQ(order[4], std::string(kStagingMarkerName));
  WriteCheckpoint(dir, {{"a.bin", Pattern(10, 4)}});
  for (size_t removed = 0; removed < order.size(); ++removed) {
    SCOPED_TRACE("stopped after " + std::to_string(removed) + " files");
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(0);
    ASSERT_EQ(waitpid(child, nullptr, 0), child);  // A dead pid.
    const fs::path dead = tmp.path() / ("ckpt.tmp-" + std::to_string(child));
    fs::copy(model, dead);
    for (size_t i = 0; i < removed; ++i) fs::remove(dead / order[i]);
    EXPECT_TRUE(IsStagingDirectory(dead) || fs::is_empty(dead));
    auto next = CheckpointWriter::Begin(dir);
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    EXPECT_FALSE(fs::exists(dead)) << "left: " << ::testing::PrintToString(List(dead));
  }
  ASSERT_FALSE(RemoveOwnedDirectory(model));
  EXPECT_FALSE(fs::exists(model));
}

TEST(CheckpointFilesTest, LeftoversAreRecognisedByContentNotName) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // A dead pid.
  const fs::path staging = tmp.path() / ("ckpt.tmp-" + std::to_string(child));
  const fs::path old = tmp.path() / ("ckpt.old-" + std::to_string(child));
  const fs::path own = tmp.path() / ("ckpt.tmp-" + std::to_string(getpid()));
  for (const fs::path& path : {staging, old}) {
    fs::create_directory(path);
    WriteText(path / "thesis.tex", "years of work");
  }
  WriteCheckpoint(dir, {{"a.bin", Pattern(10, 3)}});  // So that `old` is not restored.
  EXPECT_EQ(ReadText(staging / "thesis.tex"), "years of work");
  EXPECT_EQ(ReadText(old / "thesis.tex"), "years of work");
  fs::create_directory(own);
  WriteText(own / "thesis.tex", "years of work");
  const Status taken = CheckpointWriter::Begin(dir).status();
  EXPECT_EQ(taken.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(taken, "taken by something Strata did not create")) << taken.message();
  EXPECT_EQ(ReadText(own / "thesis.tex"), "years of work");
}

// The manifest's checksum is checked before any of its fields is used: a hand edit of a value
// is DataLoss; a manifest that only changed its layout is still read.
TEST(CheckpointFilesTest, OpenChecksTheManifestChecksum) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  {
    auto writer = CheckpointWriter::Begin(dir);
    ASSERT_TRUE(writer.ok());
    nlohmann::json manifest = NewManifest();
    manifest["engine"] = {{"step_count", 7}, {"lr", 0.1}};
    ASSERT_TRUE(writer->Commit(manifest).ok());
  }
  const fs::path path = dir / "manifest.json";
  nlohmann::json saved = nlohmann::json::parse(ReadText(path));
  WriteText(path, saved.dump(4));  // Other whitespace: the same content.
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest()["engine"]["step_count"], 7);
  EXPECT_FALSE(reader->manifest().contains("checksum"));

  nlohmann::json edited = saved;
  edited["engine"]["step_count"] = 8;
  WriteText(path, edited.dump(2));
  reader = CheckpointReader::Open(dir);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(reader.status(), "checksum")) << reader.status().message();

  edited = saved;
  edited["checksum"] = 12;
  WriteText(path, edited.dump(2));
  EXPECT_EQ(CheckpointReader::Open(dir).status().code(), StatusCode::kDataLoss);
}

// A manifest written before manifests had a checksum and a "contents" list still loads (with a
// warning: only its data files' checksums vouch for it), and a save may replace its directory
// when that holds nothing but the files its chunks name.
TEST(CheckpointFilesTest, ManifestsWithoutAChecksumStillLoadAndAreReplaced) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "old";
  fs::create_directory(dir);
  const auto data = Pattern(32, 5);
  {
    std::ofstream out(dir / "chunk-000000.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  }
  const nlohmann::json legacy = {
      {"format", "strata-checkpoint"},
      {"version", 1},
      {"chunks", {{{"file", "chunk-000000.bin"}, {"bytes", 32}, {"xxh3", DigestOf(data).xxh3}}}}};
  WriteText(dir / "manifest.json", legacy.dump(2));
  std::vector<std::string> warnings;
  SetLogSink([&](LogLevel level, std::string_view message) {
    if (level == LogLevel::kWarning) warnings.emplace_back(message);
  });
  auto reader = CheckpointReader::Open(dir);
  SetLogSink(nullptr);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->manifest(), legacy);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("has no checksum"), std::string::npos) << warnings[0];
  EXPECT_TRUE(CheckReplaceable(dir).ok());

  WriteText(dir / "mine.txt", "not a checkpoint's");
  EXPECT_EQ(CheckReplaceable(dir).code(), StatusCode::kFailedPrecondition);
  fs::remove(dir / "mine.txt");
  WriteCheckpoint(dir, {{"a.bin", Pattern(8, 6)}});
  EXPECT_EQ(List(dir), (std::vector<std::string>{"a.bin", "manifest.json"}));
}

// A manifest or data file that is not a regular file is refused at once, naming what it is:
// a FIFO would block the read forever, /dev/zero would never end.
TEST(CheckpointFilesTest, HostileFilesAreRefusedAtOnce) {
  ScratchDir tmp;
  const fs::path dir = tmp.path() / "ckpt";
  const auto data = Pattern(64, 4);
  WriteCheckpoint(dir, {{"a.bin", data}});
  auto reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> out;

  fs::remove(dir / "a.bin");
  ASSERT_EQ(mkfifo((dir / "a.bin").c_str(), 0644), 0);
  Status status = ReadAll(*reader, "a.bin", DigestOf(data), &out);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(status, "is not a regular file: it is a FIFO")) << status.message();

  fs::remove(dir / "a.bin");
  fs::create_directory(dir / "a.bin");
  status = ReadAll(*reader, "a.bin", DigestOf(data), &out);
  EXPECT_TRUE(Contains(status, "it is a directory")) << status.message();

  fs::remove(dir / "a.bin");
  fs::create_symlink("/dev/zero", dir / "a.bin");
  status = ReadAll(*reader, "a.bin", DigestOf(data), &out);
  EXPECT_TRUE(Contains(status, "it is a character device")) << status.message();
  // A link to a regular file is read (a checkpoint in a cache of links to blobs): its content
  // is what the checksum checks.
  fs::remove(dir / "a.bin");
  {
    std::ofstream blob(tmp.path() / "blob", std::ios::binary);
    blob.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  }
  fs::create_symlink(tmp.path() / "blob", dir / "a.bin");
  EXPECT_TRUE(ReadAll(*reader, "a.bin", DigestOf(data), &out).ok());
  EXPECT_EQ(out, data);

  fs::remove(dir / "manifest.json");
  ASSERT_EQ(mkfifo((dir / "manifest.json").c_str(), 0644), 0);
  EXPECT_TRUE(Contains(CheckpointReader::Open(dir).status(), "it is a FIFO"));
  fs::remove(dir / "manifest.json");
  fs::create_symlink("/dev/zero", dir / "manifest.json");
  EXPECT_TRUE(Contains(CheckpointReader::Open(dir).status(), "it is a character device"));
}

// A bare relative name is a directory in the working directory, as "./name" is.
TEST(CheckpointFilesTest, RelativeNamesAreResolvedAgainstTheWorkingDirectory) {
  ScratchDir tmp;
  const fs::path cwd = fs::current_path();
  fs::current_path(tmp.path());
  for (int save = 0; save < 2; ++save) {
    auto writer = CheckpointWriter::Begin("ck");
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    EXPECT_EQ(writer->dir(), fs::canonical(tmp.path()) / "ck");
    const Status committed = writer->Commit(NewManifest());
    EXPECT_TRUE(committed.ok()) << committed.ToString();
  }
  EXPECT_TRUE(CheckpointReader::Open("ck").ok());
  fs::current_path(cwd);
}

// Checked before a trainer's first step: a read-only or missing place says so, without writing.
TEST(CheckpointFilesTest, CheckCheckpointTargetWritesNothing) {
  ScratchDir tmp;
  EXPECT_TRUE(CheckCheckpointTarget(tmp.path() / "ck", 4096).ok());
  EXPECT_TRUE(fs::is_empty(tmp.path()));
  EXPECT_EQ(CheckCheckpointTarget(tmp.path() / "missing" / "ck", 0).code(), StatusCode::kNotFound);
  EXPECT_EQ(CheckCheckpointTarget(tmp.path() / "ck", uint64_t{1} << 60).code(),
            StatusCode::kResourceExhausted);
  const Status proc = CheckCheckpointTarget("/proc/strata-checkpoint", 0);
  EXPECT_FALSE(proc.ok());
  EXPECT_TRUE(fs::is_empty(tmp.path()));
}

}  // namespace
}  // namespace strata::offload::internal
