#include "strata/core/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>

namespace strata {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int half, Half(x));
  STRATA_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

Status CheckEven(int x) {
  STRATA_RETURN_IF_ERROR(Half(x));
  return Status();
}

TEST(StatusTest, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, CodeNameAndMessage) {
  Status s = DataLoss("extent 7 of /nvme/swap0: checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.ToString(), "DataLoss: extent 7 of /nvme/swap0: checksum mismatch");
}

TEST(StatusTest, WithContextPrefixesMessageKeepsCode) {
  Status s = NotFound("no such file").WithContext("loading checkpoint /ckpt");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "loading checkpoint /ckpt: no such file");
  EXPECT_TRUE(Status().WithContext("ignored").ok());
}

TEST(StatusTest, ErrnoErrorNamesErrno) {
  Status s = ErrnoError("pwrite /x offset 4096", ENOSPC);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("pwrite /x offset 4096"), std::string::npos);
  EXPECT_NE(s.message().find("No space left on device"), std::string::npos);
  EXPECT_NE(s.message().find("errno 28"), std::string::npos);
}

TEST(ResultTest, ValueAndError) {
  Result<int> good = Half(8);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 4);
  EXPECT_TRUE(good.status().ok());
  Result<int> bad = Half(3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(12), 3);
  Result<int> r = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd: 3");
  EXPECT_TRUE(CheckEven(2).ok());
  EXPECT_EQ(CheckEven(1).code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

}  // namespace
}  // namespace strata
