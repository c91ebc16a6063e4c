# Catch2 v2's single header (catch2/catch.hpp), for the C++ tests (KILN_BUILD_TESTS=ON) only. Catch2 v3 has no
# such header, so where only v3 is installed (the GPU machine) KILN_CATCH2_INCLUDE stays unset and the tests
# are skipped with a message.
find_path(KILN_CATCH2_INCLUDE catch2/catch.hpp)
