// common/sha256: SHA-256 through libcrypto, opened at run time.
#include <catch2/catch.hpp>

#include <string>

#include "common/sha256.h"

using kiln::sha256_hex;

TEST_CASE("sha256_hex is SHA-256 (FIPS 180-2 test vectors)") {
  REQUIRE(kiln::sha256_unavailable().empty());
  CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha256_hex(std::string(1000000, 'a')) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}
