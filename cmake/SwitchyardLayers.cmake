# The layer rule: core <- kernels <- comm <- moe <- parallel <- train <- cli.
# sy_add_layer(NAME SOURCES... DEPENDS lower_layer) creates the static library sy_<NAME>.
# A layer links only the layer directly below it (and so, transitively, all lower ones);
# tests/check_layering.cmake rejects any #include of a higher layer's header.
set(SY_LAYER_ORDER core kernels comm moe parallel train cli CACHE INTERNAL "")

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
  target_include_directories(sy_${name} PUBLIC ${PROJECT_SOURCE_DIR}/include
                                         PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(sy_${name} PUBLIC sy_options)
  foreach(dep IN LISTS ARG_DEPENDS)
    target_link_libraries(sy_${name} PUBLIC sy_${dep})
  endforeach()
  if(ARG_PRIVATE_LIBS)
    target_link_libraries(sy_${name} PRIVATE ${ARG_PRIVATE_LIBS})
  endif()
endfunction()
