# pybind11 headers: torch's bundled copy when torch is there (one pybind11 per process), else pip's.
# Sets KILN_PYBIND11_INCLUDE; include after torch.cmake.
if(KILN_HAVE_TORCH)
  set(KILN_PYBIND11_INCLUDE "${TORCH_INSTALL_PREFIX}/include")
else()
  execute_process(COMMAND ${Python_EXECUTABLE} -c "import pybind11; print(pybind11.get_include(), end='')"
                  OUTPUT_VARIABLE KILN_PYBIND11_INCLUDE RESULT_VARIABLE _pb_rc)
  if(NOT _pb_rc EQUAL 0)
    message(FATAL_ERROR "kiln: pybind11 is needed to build (pip install pybind11)")
  endif()
endif()
