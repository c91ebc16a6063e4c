# ccache (a build tool, optional): when it is on the PATH, every C and C++ compile goes through it, so a fresh
# clone or build folder reuses objects compiled before (scripts/setup.sh sets CCACHE_BASEDIR for that).
find_program(KILN_CCACHE ccache)
if(KILN_CCACHE)
  set(CMAKE_C_COMPILER_LAUNCHER ${KILN_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${KILN_CCACHE})
endif()
