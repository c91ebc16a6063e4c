# CPython's headers, for the Python named by -DPython_EXECUTABLE (else the first on the PATH): both extension
# modules are built for that interpreter only.
find_package(Python REQUIRED COMPONENTS Interpreter Development.Module)
if(KILN_BUILD_TESTS)
  # The C++ tests embed an interpreter, so they also need libpython itself.
  find_package(Python REQUIRED COMPONENTS Interpreter Development.Module Development.Embed)
endif()
