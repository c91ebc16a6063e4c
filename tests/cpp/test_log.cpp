#include <catch2/catch.hpp>

#include "common/error.h"
#include "common/log.h"

TEST_CASE("KILN_LOGS parsing turns categories on and rejects unknown names") {
  kiln::log::configure("graph,guards");
  CHECK(kiln::log::enabled(kiln::log::Category::graph));
  CHECK(kiln::log::enabled(kiln::log::Category::guards));
  CHECK_FALSE(kiln::log::enabled(kiln::log::Category::recompiles));
  CHECK_THROWS_WITH(kiln::log::configure("graph,nonsense"),
                    Catch::Contains("unknown log category 'nonsense'"));
  kiln::log::configure("all");
  CHECK(kiln::log::enabled(kiln::log::Category::perf));
  kiln::log::configure("");
  CHECK_FALSE(kiln::log::enabled(kiln::log::Category::graph));
}

TEST_CASE("KILN_CHECK and KILN_ASSERT raise kiln::Error of the right kind") {
  auto user = [] { KILN_CHECK(1 == 2) << "one is not two"; };
  auto internal = [] { KILN_ASSERT(false) << "broken"; };
  try {
    user();
    FAIL("no throw");
  } catch (const kiln::Error& e) {
    CHECK(e.kind() == kiln::ErrorKind::User);
    CHECK(std::string(e.what()) == "one is not two");
  }
  try {
    internal();
    FAIL("no throw");
  } catch (const kiln::Error& e) {
    CHECK(e.kind() == kiln::ErrorKind::Internal);
    CHECK_THAT(e.what(), Catch::Contains("please report") || Catch::Contains("Please report"));
  }
}
