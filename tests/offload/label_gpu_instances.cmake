# Run by ctest after offload_tests' discovered tests are defined (TEST_INCLUDE_FILES): the
# instances of the suites parametrised over DeviceUnderTest that run on CUDA (Cuda/...) take the
# `gpu` label instead of `offload`, so a CPU machine leaves them out with `ctest -LE gpu` as it
# does every other GPU test, and `ctest -L gpu` on a GPU runs them.
foreach(test IN LISTS offload_tests_TESTS)
  if(test MATCHES "^Cuda/")
    set_tests_properties("${test}" PROPERTIES LABELS gpu)
  endif()
endforeach()
