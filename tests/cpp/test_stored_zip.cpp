// common/stored_zip.h: reading zip files of stored entries (the layout of kiln.export's files), CRC-32 checks, and
// the archives it refuses.
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/stored_zip.h"

using kiln::StoredZip;

namespace {

void put16(std::string& out, uint32_t v) {
  out += static_cast<char>(v & 0xff);
  out += static_cast<char>((v >> 8) & 0xff);
}
void put32(std::string& out, uint32_t v) {
  put16(out, v & 0xffff);
  put16(out, v >> 16);
}

// A zip of `entries` as Python's zipfile writes ZIP_STORED archives (`method` other than 0 marks them compressed).
std::string make_zip(const std::vector<std::pair<std::string, std::string>>& entries, uint16_t method = 0) {
  std::string data, directory;
  for (const auto& [name, content] : entries) {
    const auto offset = static_cast<uint32_t>(data.size());
    const uint32_t crc = kiln::crc32(content);
    put32(data, 0x04034b50);
    put16(data, 20), put16(data, 0), put16(data, method), put16(data, 0), put16(data, 0);
    put32(data, crc), put32(data, content.size()), put32(data, content.size());
    put16(data, name.size()), put16(data, 0);
    data += name + content;
    put32(directory, 0x02014b50);
    put16(directory, 20), put16(directory, 20), put16(directory, 0), put16(directory, method);
    put16(directory, 0), put16(directory, 0);
    put32(directory, crc), put32(directory, content.size()), put32(directory, content.size());
    put16(directory, name.size()), put16(directory, 0), put16(directory, 0), put16(directory, 0), put16(directory, 0);
    put32(directory, 0), put32(directory, offset);
    directory += name;
  }
  std::string zip = data + directory;
  put32(zip, 0x06054b50);
  put16(zip, 0), put16(zip, 0), put16(zip, entries.size()), put16(zip, entries.size());
  put32(zip, directory.size()), put32(zip, data.size()), put16(zip, 0);
  return zip;
}

}  // namespace

TEST_CASE("crc32 is zip's CRC-32") {
  CHECK(kiln::crc32("123456789") == 0xcbf43926u);
  CHECK(kiln::crc32("") == 0u);
}

TEST_CASE("a zip of stored entries reads back entry by entry") {
  const StoredZip zip = StoredZip::from_bytes(make_zip({{"manifest.json", "{}"}, {"weights", std::string(1000, 'w')}}),
                                              "test.kiln");
  REQUIRE(zip.entries().size() == 2);
  CHECK(zip.read("manifest.json") == "{}");
  CHECK(zip.read("weights") == std::string(1000, 'w'));
  CHECK_FALSE(zip.contains("graph.json"));
  CHECK_THROWS_WITH(zip.read("graph.json"), Catch::Contains("test.kiln has no entry graph.json"));
}

TEST_CASE("corrupted, truncated and compressed archives raise errors naming the file") {
  std::string bytes = make_zip({{"a.txt", "hello world"}});
  std::string flipped = bytes;
  flipped[flipped.find("hello")] = 'j';
  CHECK_THROWS_WITH(StoredZip::from_bytes(flipped, "x.kiln").read("a.txt"), Catch::Contains("does not match its CRC-32"));
  CHECK_THROWS_WITH(StoredZip::from_bytes(bytes.substr(0, bytes.size() / 2), "x.kiln"),
                    Catch::Contains("x.kiln is not a zip file"));
  CHECK_THROWS_WITH(StoredZip::from_bytes("short", "x.kiln"), Catch::Contains("not a zip file"));
  CHECK_THROWS_WITH(StoredZip::from_bytes(make_zip({{"a.txt", "hello"}}, 8), "x.kiln"),
                    Catch::Contains("entry a.txt is compressed"));
  CHECK_THROWS_AS(StoredZip::open("/nonexistent/model.kiln"), kiln::Error);
}
