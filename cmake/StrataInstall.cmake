# `cmake --install` lays out headers, libraries, the strata tool and a package config, so another
# project can find_package(strata) and link strata::core, strata::offload and the rest.
include(CMakePackageConfigHelpers)

install(TARGETS strata_core strata_nvme strata_cpu_adam strata_cpu_adam_c strata_offload
        EXPORT strataTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY core/include/ nvme/include/ cpu_adam/include/ offload/include/
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS strata RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(STRATA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${STRATA_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake INSTALL_DESTINATION ${STRATA_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake
              ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${STRATA_INSTALL_CMAKEDIR})
