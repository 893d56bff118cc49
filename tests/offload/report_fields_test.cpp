// Tests for the field lists of StepReport and EngineCounters (strata/offload/engine.h): each
// names every field of its struct once, in declaration order, so code that walks the list (the
// counters' sums, strata.torch's dicts) cannot miss a field someone adds.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "strata/offload/engine.h"

namespace strata::offload {
namespace {

/// Converts to any field's type, to count the initializers an aggregate takes.
struct AnyField {
  template <typename T>
  constexpr operator T() const noexcept {  // NOLINT(google-explicit-constructor)
    return T{};
  }
};

/// How many fields the aggregate `T` has (of scalar types, as these structs' are): the most
/// initializers `T{...}` takes.
template <typename T, typename... Initializers>
constexpr size_t AggregateFieldCount() {
  if constexpr (requires { T{Initializers{}..., AnyField{}}; }) {
    return AggregateFieldCount<T, Initializers..., AnyField>();
  } else {
    return sizeof...(Initializers);
  }
}

template <typename T>
constexpr size_t ListedFieldCount() {
  size_t count = 0;
  T::ForEachField([&count](const char*, auto) { ++count; });
  return count;
}

// A member added to the struct and not to its ForEachField fails here, at compile time.
static_assert(ListedFieldCount<StepReport>() == AggregateFieldCount<StepReport>(),
              "StepReport::ForEachField must list every field of StepReport");
static_assert(ListedFieldCount<EngineCounters>() == AggregateFieldCount<EngineCounters>(),
              "EngineCounters::ForEachField must list every field of EngineCounters");

/// The fields' byte offsets in the order the list names them, and their names.
template <typename T>
void ListedFields(std::vector<size_t>* offsets, std::vector<std::string>* names) {
  const T object{};
  T::ForEachField([&](const char* name, auto member) {
    offsets->push_back(size_t(reinterpret_cast<const char*>(&(object.*member)) -
                              reinterpret_cast<const char*>(&object)));
    names->push_back(name);
  });
}

template <typename T>
void ExpectEachFieldOnceInOrder() {
  std::vector<size_t> offsets;
  std::vector<std::string> names;
  ListedFields<T>(&offsets, &names);
  ASSERT_EQ(offsets.size(), AggregateFieldCount<T>());
  // Strictly increasing offsets: no field twice (so, with the count, every field) and the
  // declaration order, which is the order of the Python dicts' keys.
  for (size_t i = 1; i < offsets.size(); ++i) {
    EXPECT_LT(offsets[i - 1], offsets[i]) << names[i - 1] << " before " << names[i];
  }
  const std::set<std::string> unique(names.begin(), names.end());
  EXPECT_EQ(unique.size(), names.size());
  for (const std::string& name : names) EXPECT_FALSE(name.empty());
}

TEST(ReportFieldsTest, StepReportListsEachFieldOnceInDeclarationOrder) {
  ExpectEachFieldOnceInOrder<StepReport>();
}

TEST(ReportFieldsTest, EngineCountersListsEachFieldOnceInDeclarationOrder) {
  ExpectEachFieldOnceInOrder<EngineCounters>();
}

TEST(ReportFieldsTest, StepReportNamesAreStrataTorchsKeys) {
  std::vector<size_t> offsets;
  std::vector<std::string> names;
  ListedFields<StepReport>(&offsets, &names);
  EXPECT_EQ(names,
            (std::vector<std::string>{"step", "iteration", "skipped", "rolled_back",
                                      "changed_chunks", "grad_norm", "loss_scale", "seconds"}));
}

TEST(ReportFieldsTest, CountersAddAndSubtractEveryField) {
  EngineCounters a;
  EngineCounters b;
  int value = 0;
  EngineCounters::ForEachField([&](const char*, auto member) {
    ++value;
    a.*member = static_cast<std::remove_reference_t<decltype(a.*member)>>(10 * value);
    b.*member = static_cast<std::remove_reference_t<decltype(b.*member)>>(value);
  });
  EngineCounters sum = a;
  sum += b;
  const EngineCounters difference = a - b;
  value = 0;
  EngineCounters::ForEachField([&](const char* name, auto member) {
    ++value;
    EXPECT_EQ(double(sum.*member), 11.0 * value) << name;
    EXPECT_EQ(double(difference.*member), 9.0 * value) << name;
  });
}

}  // namespace
}  // namespace strata::offload
