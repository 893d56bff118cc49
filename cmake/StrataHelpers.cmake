# Warnings for every Strata target; errors too when STRATA_WARNINGS_AS_ERRORS is on (CI).
# -Wno-missing-field-initializers: GCC 12 warns on designated initializers that leave defaulted
# fields out, which is exactly how our option structs are meant to be built.
function(strata_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-missing-field-initializers
      $<$<BOOL:${STRATA_WARNINGS_AS_ERRORS}>:-Werror>>)
endfunction()

# For a target whose code awaits Boost.Asio's awaitables: GCC misreads the frames of coroutines
# whose promise brings its own operator new/delete, and after inlining -Wmismatched-new-delete
# reports the frame's sized delete as mismatched with its new (which inlining it is depends on
# the optimisation level and the code around it). A false positive (GCC PR middle-end/109224);
# the frames are checked by AddressSanitizer in CI instead.
function(strata_allow_asio_coroutines target)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(${target} PRIVATE -Wno-mismatched-new-delete)
  endif()
endfunction()

# strata_add_test(NAME name SOURCES ... LIBS ... [LABELS ...])
# One gtest binary per source folder; each TEST becomes its own CTest entry carrying LABELS.
function(strata_add_test)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  strata_set_warnings(${ARG_NAME})
  gtest_discover_tests(${ARG_NAME} DISCOVERY_MODE PRE_TEST
                       PROPERTIES LABELS "${ARG_LABELS}")
endfunction()

# strata_add_library(NAME folder SOURCES ... [PUBLIC deps...] [PRIVATE deps...])
# One static library per folder: target strata_<folder>, alias strata::<folder>, public headers
# in <folder>/include, warnings on. Like Abseil's absl_cc_library.
function(strata_add_library)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;PUBLIC;PRIVATE" ${ARGN})
  set(target strata_${ARG_NAME})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(strata::${ARG_NAME} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${ARG_NAME})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC} PRIVATE ${ARG_PRIVATE})
  strata_set_warnings(${target})
endfunction()
