# Fails if a file of the repository cites something that is not in the repository: a section of a
# "SPEC" document, MACHINE.md, a path under ../shared, or an issue by its number. What the code
# relies on belongs in docs/, in the repository's own words; cite the doc and its section heading
# instead (e.g. docs/moe.md, "Slots and capacity").
# Usage: cmake -DROOT=<source dir> -P check_citations.cmake

# Files allowed to cite (none: every citation has been replaced). An entry that no longer cites
# fails, so the list can only shrink.
set(allowed)

# A whole word SPEC or MACHINE (SPEC §2, SPEC.md, SPEC's, MACHINE.md), ../shared, issue 7 / issue #7.
set(word_before "(^|[^A-Za-z0-9_])")
set(word_after "([^A-Za-z0-9_]|$)")
set(pattern "${word_before}(SPEC|MACHINE)${word_after}|\\.\\./shared|[Ii]ssue #?[0-9]")

file(GLOB_RECURSE files LIST_DIRECTORIES false RELATIVE ${ROOT}
     ${ROOT}/include/* ${ROOT}/src/* ${ROOT}/tests/* ${ROOT}/bench/* ${ROOT}/docs/*
     ${ROOT}/scripts/* ${ROOT}/cmake/* ${ROOT}/fuzz/*.cc ${ROOT}/fuzz/CMakeLists.txt)
list(APPEND files README.md CMakeLists.txt)
list(REMOVE_ITEM files tests/check_citations.cmake)

set(violations "")
foreach(f IN LISTS files)
  file(READ ${ROOT}/${f} text)
  set(hits "")
  # Most files mention none of the words: look at their lines only when the whole text does.
  if(text MATCHES "SPEC|MACHINE|\\.\\./shared|ssue #?[0-9]")
    # One list element per line: characters that would split or join list elements are replaced
    # (the lines are only matched and printed).
    foreach(special ";" "[" "]" "\\")
      string(REPLACE "${special}" "_" text "${text}")
    endforeach()
    string(REPLACE "\n" ";" lines "${text}")
    set(number 0)
    foreach(line IN LISTS lines)
      math(EXPR number "${number} + 1")
      if(line MATCHES "${pattern}")
        string(STRIP "${line}" line)
        list(APPEND hits "${f}:${number}: ${line}")
      endif()
    endforeach()
  endif()
  list(FIND allowed ${f} allowed_index)
  if(allowed_index GREATER -1)
    if(NOT hits)
      list(APPEND violations "${f}: cites nothing outside the repository any more; remove it from \
the list 'allowed' in tests/check_citations.cmake")
    endif()
  else()
    list(APPEND violations ${hits})
  endif()
endforeach()

if(violations)
  list(JOIN violations "\n" text)
  message(FATAL_ERROR
          "citations of documents outside the repository (SPEC sections, MACHINE.md, ../shared, "
          "issue numbers); state the semantics in docs/ and cite the doc and its section:\n${text}")
endif()
list(LENGTH files n)
message(STATUS "citations: ok (${n} files)")
