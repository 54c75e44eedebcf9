# Fails if a file of layer L includes a header of a layer above L, or if parallel/, train/ or plan/
# include a concrete transport (comm/inprocess.h, comm/mpi.h).
# Usage: cmake -DROOT=<source dir> -DLAYERS="core;kernels;..." -P check_layering.cmake
set(violations "")
list(LENGTH LAYERS n)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  list(GET LAYERS ${i} layer)
  file(GLOB_RECURSE files ${ROOT}/src/${layer}/*.h ${ROOT}/src/${layer}/*.cc
                          ${ROOT}/include/switchyard/${layer}/*.h)
  foreach(f IN LISTS files)
    file(STRINGS ${f} includes REGEX "^#include \"")
    foreach(line IN LISTS includes)
      foreach(j RANGE ${last})
        if(j GREATER i)
          list(GET LAYERS ${j} higher)
          if(line MATCHES "^#include \"(switchyard/)?${higher}/")
            list(APPEND violations "${f}: layer '${layer}' includes '${higher}': ${line}")
          endif()
        endif()
      endforeach()
    endforeach()
  endforeach()
endforeach()
# The transport is the program's choice: library layers above comm use the abstract Communicator
# and Launcher, never a concrete transport's header.
foreach(layer IN ITEMS parallel train plan)
  file(GLOB_RECURSE files ${ROOT}/src/${layer}/*.h ${ROOT}/src/${layer}/*.cc
                          ${ROOT}/include/switchyard/${layer}/*.h)
  foreach(f IN LISTS files)
    file(STRINGS ${f} includes REGEX "^#include \"(switchyard/)?comm/(inprocess|mpi)\\.h\"")
    foreach(line IN LISTS includes)
      list(APPEND violations "${f}: layer '${layer}' includes a concrete transport: ${line}")
    endforeach()
  endforeach()
endforeach()
# train/dataset (library sy_train_data) depends on core only: the formats and tokenizers are
# usable and testable without the model.
file(GLOB_RECURSE files ${ROOT}/src/train/dataset/*.h ${ROOT}/src/train/dataset/*.cc
                        ${ROOT}/include/switchyard/train/dataset/*.h)
foreach(f IN LISTS files)
  file(STRINGS ${f} includes REGEX "^#include \"")
  foreach(line IN LISTS includes)
    if(NOT line MATCHES "^#include \"(switchyard/core/|switchyard/train/dataset/|train/dataset/)")
      list(APPEND violations "${f}: train/dataset may include core only: ${line}")
    endif()
  endforeach()
endforeach()
if(violations)
  list(JOIN violations "\n" text)
  message(FATAL_ERROR "layering violations (order: ${LAYERS}):\n${text}")
endif()
message(STATUS "layering: ok")
