# `cmake --install <build> --prefix P` (docs/library.md) puts into P:
#   include/switchyard/**                     the public headers (src/ stays private)
#   lib/libswitchyard_<layer>.a               one static library per layer (sy_add_layer)
#   lib/cmake/switchyard/                     the CMake package: find_package(switchyard) defines
#                                             switchyard::<layer> and switchyard::switchyard
#   bin/switchyard                            the command-line program (when SY_BUILD_CLI)
include(CMakePackageConfigHelpers)

set(SY_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/switchyard)

# switchyard::switchyard: every library layer at once.
get_property(sy_library_layers GLOBAL PROPERTY SY_LIBRARY_LAYERS)
add_library(sy_all INTERFACE)
add_library(switchyard::switchyard ALIAS sy_all)
set_target_properties(sy_all PROPERTIES EXPORT_NAME switchyard)
foreach(layer IN LISTS sy_library_layers)
  target_link_libraries(sy_all INTERFACE sy_${layer})
endforeach()
install(TARGETS sy_all EXPORT switchyardTargets)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/switchyard
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h" PATTERN "*.def")
if(TARGET switchyard)
  install(TARGETS switchyard RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(EXPORT switchyardTargets NAMESPACE switchyard:: DESTINATION ${SY_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/switchyardConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/switchyardConfig.cmake
                              INSTALL_DESTINATION ${SY_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/switchyardConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/switchyardConfig.cmake
              ${PROJECT_BINARY_DIR}/switchyardConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/SwitchyardMathLibs.cmake
        DESTINATION ${SY_INSTALL_CMAKEDIR})
