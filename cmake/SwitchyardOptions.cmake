# Compiler flags shared by every target of the project.
add_library(sy_options INTERFACE)
target_compile_options(sy_options INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter)
if(SY_WERROR)
  target_compile_options(sy_options INTERFACE -Werror)
endif()
if(SY_SANITIZE)
  target_compile_options(sy_options INTERFACE -fsanitize=${SY_SANITIZE} -fno-omit-frame-pointer
                                              -fno-sanitize-recover=all)
  target_link_options(sy_options INTERFACE -fsanitize=${SY_SANITIZE})
endif()
