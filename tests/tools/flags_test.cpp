#include "flags.h"

#include <gtest/gtest.h>

namespace strata::tools {
namespace {

/// A parser with one flag of each kind, bound to its own fields.
struct TestCommand {
  std::string path;
  bool json = false;
  uint64_t size = 0;
  int64_t steps = 10;
  double lr = 0.1;
  std::string file;
  FlagParser parser{"strata test", "A test command."};

  TestCommand() {
    parser.AddString("path", &path, "DIR", "a directory");
    parser.AddBool("json", &json, "json output");
    parser.AddBytes("size", &size, "a size");
    parser.AddInt("steps", &steps, "steps");
    parser.AddDouble("lr", &lr, "learning rate");
    parser.AddPositional("FILE", &file, "a file", false);
  }
};

Status Parse(const std::vector<std::string>& args) { return TestCommand().parser.Parse(args); }

TEST(FlagParserTest, ParsesAllKinds) {
  TestCommand p;
  ASSERT_TRUE(p.parser
                  .Parse({"in.json", "--path", "/x", "--json", "--size=1.5GiB", "--steps", "-3",
                          "--lr", "3e-4"})
                  .ok());
  EXPECT_EQ(p.file, "in.json");
  EXPECT_EQ(p.path, "/x");
  EXPECT_TRUE(p.json);
  EXPECT_EQ(p.size, 1610612736u);
  EXPECT_EQ(p.steps, -3);
  EXPECT_DOUBLE_EQ(p.lr, 3e-4);
}

// A caller whose default depends on the context (strata plan's --gpus under a launcher) asks
// whether the user gave the flag, whatever value it has.
TEST(FlagParserTest, SaysWhichFlagsWereGiven) {
  TestCommand p;
  ASSERT_TRUE(p.parser.Parse({"--steps", "10", "--json"}).ok());
  EXPECT_TRUE(p.parser.was_set("steps"));  // Given, though equal to the default.
  EXPECT_TRUE(p.parser.was_set("json"));
  EXPECT_FALSE(p.parser.was_set("lr"));
  ASSERT_TRUE(p.parser.Parse({"--lr", "1"}).ok());
  EXPECT_FALSE(p.parser.was_set("steps"));  // Of the last Parse only.
  EXPECT_TRUE(p.parser.was_set("lr"));
}

TEST(FlagParserTest, ErrorsNameTheFlagAndValue) {
  Status s = Parse({"--size", "12XB"});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--size"), std::string::npos);
  EXPECT_NE(s.message().find("12XB"), std::string::npos);
  EXPECT_NE(Parse({"--steps", "ten"}).message().find("ten"), std::string::npos);
  EXPECT_NE(Parse({"--lr", "nan"}).message().find("--lr"), std::string::npos);
  EXPECT_NE(Parse({"--json=yes"}).message().find("takes no value"), std::string::npos);
  EXPECT_NE(Parse({"--nope"}).message().find("unknown flag --nope"), std::string::npos);
  EXPECT_NE(Parse({"a", "b"}).message().find("unexpected argument \"b\""), std::string::npos);
}

TEST(FlagParserTest, HelpListsFlags) {
  TestCommand p;
  ASSERT_TRUE(p.parser.Parse({"--help"}).ok());
  EXPECT_TRUE(p.parser.help_requested());
  const std::string help = p.parser.Help();
  EXPECT_NE(help.find("--path DIR"), std::string::npos);
  EXPECT_NE(help.find("--json"), std::string::npos);
  EXPECT_NE(help.find("[FILE]"), std::string::npos);
}

}  // namespace
}  // namespace strata::tools
