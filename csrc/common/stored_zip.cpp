// StoredZip (stored_zip.h): the zip layout from PKWARE's APPNOTE.TXT, sections 4.3.7 (local file header),
// 4.3.12 (central directory header) and 4.3.16 (end of central directory record). The central directory is
// authoritative for names, sizes and offsets; each local header is checked to name the same entry, since its
// variable-length fields decide where the data starts.
#include "common/stored_zip.h"

#include <array>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace kiln {

namespace {

constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr uint32_t kCentralHeader = 0x02014b50;
constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr size_t kEndOfDirectorySize = 22;
constexpr size_t kMaxComment = 0xffff;

uint32_t u32(std::string_view bytes, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(bytes[at + i]);
  return v;
}

uint16_t u16(std::string_view bytes, size_t at) {
  return static_cast<uint16_t>(static_cast<uint8_t>(bytes[at]) | (static_cast<uint8_t>(bytes[at + 1]) << 8));
}

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  return table;
}

}  // namespace

uint32_t crc32(std::string_view data) {
  const auto& table = crc_table();
  uint32_t c = 0xffffffffu;
  for (char ch : data) c = table[(c ^ static_cast<uint8_t>(ch)) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

StoredZip StoredZip::open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(static_cast<bool>(in)) << "cannot open " << path << " for reading";
  std::ostringstream content;
  content << in.rdbuf();
  KILN_CHECK(!in.bad()) << "cannot read " << path;
  return from_bytes(std::move(content).str(), path);
}

StoredZip StoredZip::from_bytes(std::string bytes, const std::string& what) {
  StoredZip zip;
  zip.bytes_ = std::move(bytes);
  zip.what_ = what;
  const std::string_view b = zip.bytes_;
  const std::string damaged = ": the file is truncated or corrupted";
  KILN_CHECK(b.size() >= kEndOfDirectorySize) << what << " is not a zip file (" << b.size() << " bytes)";
  // The end record is the last 22 bytes plus a comment of at most 64 KiB: search backwards for its signature.
  size_t end = std::string::npos;
  const size_t lowest = b.size() > kEndOfDirectorySize + kMaxComment ? b.size() - kEndOfDirectorySize - kMaxComment : 0;
  for (size_t at = b.size() - kEndOfDirectorySize + 1; at-- > lowest;) {
    if (u32(b, at) == kEndOfDirectory && at + kEndOfDirectorySize + u16(b, at + 20) == b.size()) {
      end = at;
      break;
    }
  }
  KILN_CHECK(end != std::string::npos) << what << " is not a zip file (no end of central directory record)" << damaged;
  const uint16_t count = u16(b, end + 10);
  const uint32_t directory_size = u32(b, end + 12);
  const uint32_t directory_offset = u32(b, end + 16);
  KILN_CHECK(u16(b, end + 4) == 0 && u16(b, end + 6) == 0 && u16(b, end + 8) == count)
      << what << " is a multi-disk zip archive, which kiln does not read";
  KILN_CHECK(count != 0xffff && directory_offset != 0xffffffffu)
      << what << " is a zip64 archive, which kiln does not read";
  KILN_CHECK(static_cast<uint64_t>(directory_offset) + directory_size <= end)
      << what << ": the central directory lies outside the file" << damaged;
  size_t at = directory_offset;
  for (uint16_t i = 0; i < count; ++i) {
    KILN_CHECK(at + 46 <= end && u32(b, at) == kCentralHeader)
        << what << ": central directory entry " << i << " is malformed" << damaged;
    const uint16_t flags = u16(b, at + 8);
    const uint16_t method = u16(b, at + 10);
    Entry entry;
    entry.crc32 = u32(b, at + 16);
    const uint32_t compressed = u32(b, at + 20);
    entry.size = u32(b, at + 24);
    const uint16_t name_length = u16(b, at + 28);
    const size_t variable = static_cast<size_t>(name_length) + u16(b, at + 30) + u16(b, at + 32);
    const uint32_t local = u32(b, at + 42);
    KILN_CHECK(at + 46 + variable <= end) << what << ": central directory entry " << i << " is malformed" << damaged;
    entry.name = std::string(b.substr(at + 46, name_length));
    KILN_CHECK(method == 0 && compressed == entry.size)
        << what << ": entry " << entry.name << " is compressed (method " << method
        << "); kiln reads zip files whose entries are stored, as ExportedProgram.save writes them";
    KILN_CHECK((flags & 1) == 0) << what << ": entry " << entry.name << " is encrypted";
    KILN_CHECK(compressed != 0xffffffffu && local != 0xffffffffu)
        << what << ": entry " << entry.name << " needs zip64, which kiln does not read";
    KILN_CHECK(static_cast<uint64_t>(local) + 30 <= b.size() && u32(b, local) == kLocalHeader)
        << what << ": entry " << entry.name << " has no local header" << damaged;
    const uint16_t local_name_length = u16(b, local + 26);
    entry.offset = static_cast<uint64_t>(local) + 30 + local_name_length + u16(b, local + 28);
    KILN_CHECK(local_name_length == name_length && b.substr(local + 30, name_length) == entry.name)
        << what << ": entry " << entry.name << " has a local header for another name" << damaged;
    KILN_CHECK(entry.offset + entry.size <= directory_offset)
        << what << ": entry " << entry.name << " runs past the end of the data" << damaged;
    zip.entries_.push_back(std::move(entry));
    at += 46 + variable;
  }
  return zip;
}

const StoredZip::Entry* StoredZip::find(std::string_view name) const {
  for (const Entry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

std::string_view StoredZip::read(std::string_view name) const {
  const Entry* entry = find(name);
  KILN_CHECK(entry) << what_ << " has no entry " << name;
  const std::string_view data = std::string_view(bytes_).substr(entry->offset, entry->size);
  KILN_CHECK(crc32(data) == entry->crc32) << what_ << ": entry " << name
                                          << " does not match its CRC-32: the file is corrupted";
  return data;
}

}  // namespace kiln
