# The layer rule: core <- kernels <- comm <- moe <- parallel <- train <- plan <- cli.
# (plan: the layout planner, `switchyard plan`; it reads train's config, validation and memory
# estimate and parallel's schedule simulator.)
# sy_add_layer(NAME SOURCES... DEPENDS lower_layer) creates the static library sy_<NAME>.
# A layer links only the layer directly below it (and so, transitively, all lower ones);
# tests/check_layering.cmake rejects any #include of a higher layer's header.
# Each layer is also installed (cmake/SwitchyardInstall.cmake): as switchyard::<NAME> for users of
# the installed package, and under the same alias name inside this build.
include(GNUInstallDirs)
set(SY_LAYER_ORDER core kernels comm moe parallel train plan cli CACHE INTERNAL "")

function(sy_add_layer name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPENDS;PRIVATE_LIBS" ${ARGN})
  list(FIND SY_LAYER_ORDER ${name} my_index)
  if(my_index EQUAL -1)
    message(FATAL_ERROR "unknown layer '${name}'")
  endif()
  foreach(dep IN LISTS ARG_DEPENDS)
    list(FIND SY_LAYER_ORDER ${dep} dep_index)
    if(dep_index EQUAL -1 OR NOT dep_index LESS my_index)
      message(FATAL_ERROR "layer '${name}' may not depend on '${dep}' (order: ${SY_LAYER_ORDER})")
    endif()
  endforeach()
  add_library(sy_${name} STATIC ${ARG_SOURCES})
  add_library(switchyard::${name} ALIAS sy_${name})
  set_target_properties(sy_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME switchyard_${name})
  # Unity sources: a batch of a layer's files compiled as one translation unit instantiates the
  # templates they share (nlohmann-json, fmt, the standard containers) once instead of per file,
  # about half the CPU time. The GEMM kernels stay separate files (their inlining is measured).
  if(SY_UNITY_BUILD AND NOT name STREQUAL "kernels")
    set_target_properties(sy_${name} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  endif()
  target_include_directories(sy_${name} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                         PRIVATE ${PROJECT_SOURCE_DIR}/src)
  # This build's warning flags are not imposed on users of the installed package; sanitizer
  # runtimes are, since objects built with them do not link without.
  target_link_libraries(sy_${name} PUBLIC $<BUILD_INTERFACE:sy_options>)
  if(SY_SANITIZE)
    target_link_options(sy_${name} INTERFACE $<INSTALL_INTERFACE:-fsanitize=${SY_SANITIZE}>)
  endif()
  foreach(dep IN LISTS ARG_DEPENDS)
    target_link_libraries(sy_${name} PUBLIC sy_${dep})
  endforeach()
  if(ARG_PRIVATE_LIBS)
    target_link_libraries(sy_${name} PRIVATE ${ARG_PRIVATE_LIBS})
  endif()
  install(TARGETS sy_${name} EXPORT switchyardTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  set_property(GLOBAL APPEND PROPERTY SY_LIBRARY_LAYERS ${name})
endfunction()
