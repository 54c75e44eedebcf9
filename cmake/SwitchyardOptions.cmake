# Compiler flags shared by every target of the project.
add_library(sy_options INTERFACE)
target_compile_options(sy_options INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter)
if(SY_WERROR)
  target_compile_options(sy_options INTERFACE -Werror)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    # GCC 12 reports impossible overlaps inside std::string at -O2 (GCC bugs 105329, 105651),
    # notably with sanitizers on, and out-of-range memset bounds inside std::vector::resize under
    # -fsanitize=address (GCC bug 106199); keep them visible as warnings, not errors.
    target_compile_options(sy_options INTERFACE -Wno-error=restrict -Wno-error=stringop-overflow)
  endif()
endif()
if(SY_SANITIZE)
  target_compile_options(sy_options INTERFACE -fsanitize=${SY_SANITIZE} -fno-omit-frame-pointer
                                              -fno-sanitize-recover=all)
  target_link_options(sy_options INTERFACE -fsanitize=${SY_SANITIZE})
  if(SY_SANITIZE MATCHES "undefined")
    # UBSan's vptr check (a call through an object of the wrong dynamic type) costs a seventh of
    # the asan build's compile time for the few class hierarchies of the project; every other
    # check of -fsanitize=undefined stays (CI's time budget: docs/ARCHITECTURE.md, Build).
    target_compile_options(sy_options INTERFACE -fno-sanitize=vptr)
  endif()
endif()
