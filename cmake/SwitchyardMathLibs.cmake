# OpenBLAS and oneDNN, the two GEMM libraries of the kernels layer, as the imported targets
# switchyard::openblas and switchyard::dnnl. Both the build (CMakeLists.txt) and the installed
# switchyardConfig.cmake include this file, so the package's users link the libraries found the
# same way. Sets SY_MATH_LIBS_FOUND (TRUE or FALSE); never fails by itself.
#
# OpenBLAS by name, never the generic BLAS alternative (libblas3), which is ~30x slower. oneDNN
# (libdnnl) is the GEMM backend on AVX2 / AVX-512 CPUs (src/kernels/gemm_backend.cc).
find_library(SY_OPENBLAS_LIBRARY NAMES openblas)
find_library(SY_DNNL_LIBRARY NAMES dnnl)
set(SY_MATH_LIBS_FOUND FALSE)
if(SY_OPENBLAS_LIBRARY AND SY_DNNL_LIBRARY)
  set(SY_MATH_LIBS_FOUND TRUE)
  foreach(lib IN ITEMS openblas dnnl)
    string(TOUPPER ${lib} upper)
    if(NOT TARGET switchyard::${lib})
      add_library(switchyard::${lib} UNKNOWN IMPORTED)
      set_target_properties(switchyard::${lib} PROPERTIES
                            IMPORTED_LOCATION ${SY_${upper}_LIBRARY})
    endif()
  endforeach()
endif()
