# LibTorch, optional: taken from the torch that the build's Python imports (its bundled CMake config), so
# kiln._C always matches the torch it will run with. Sets KILN_HAVE_TORCH; without torch only kiln._core builds.
set(KILN_HAVE_TORCH OFF)
if(NOT KILN_CORE_ONLY)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c "import torch, os; print(torch.utils.cmake_prefix_path, end='')"
    OUTPUT_VARIABLE KILN_TORCH_PREFIX RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(_torch_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH ${KILN_TORCH_PREFIX})
    # The CUDA wheel's config looks for a toolkit; kiln never links CUDA at build time.
    find_package(Torch REQUIRED)
    find_library(KILN_TORCH_PYTHON torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
    set(KILN_HAVE_TORCH ON)
  else()
    message(STATUS "kiln: torch not importable, building only kiln._core")
  endif()
endif()
