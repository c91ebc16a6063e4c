// Catch2 v2 entry point for kiln's C++ tests. Tests that touch CPython objects start an
// embedded interpreter through tests/cpp/python_env.h.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
