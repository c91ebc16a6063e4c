// co_exceptiontable encoding (3.11+): each row is four varints — start, size, target (code units) and
// (depth << 1) | lasti. A varint is 6-bit chunks, most significant first, 0x40 = more chunks follow;
// the first byte of a row carries 0x80 so a reader can find row starts.
#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::bytecode {

namespace {
constexpr unsigned char kContinue = 0x40;
constexpr unsigned char kRowStart = 0x80;
constexpr unsigned kChunkBits = 6;
constexpr unsigned kChunkMask = 0x3f;
}  // namespace

void append_exception_varint(std::string& out, unsigned value, unsigned char first_bit) {
  KILN_ASSERT(value < (1u << 30)) << "exception table value " << value << " too large";
  int shift = 24;
  while (shift > 0 && (value >> shift) == 0) shift -= kChunkBits;
  for (; shift > 0; shift -= kChunkBits) {
    out.push_back(static_cast<char>(((value >> shift) & kChunkMask) | kContinue | first_bit));
    first_bit = 0;
  }
  out.push_back(static_cast<char>((value & kChunkMask) | first_bit));
}

std::string encode_exception_table(const std::vector<RawExceptionEntry>& entries) {
  std::string out;
  for (const RawExceptionEntry& e : entries) {
    KILN_ASSERT(e.start >= 0 && e.size > 0 && e.target >= 0 && e.depth >= 0)
        << "bad exception entry start=" << e.start << " size=" << e.size << " target=" << e.target
        << " depth=" << e.depth;
    append_exception_varint(out, e.start, kRowStart);
    append_exception_varint(out, e.size, 0);
    append_exception_varint(out, e.target, 0);
    append_exception_varint(out, (static_cast<unsigned>(e.depth) << 1) | (e.lasti ? 1u : 0u), 0);
  }
  return out;
}

std::vector<RawExceptionEntry> decode_exception_table(std::string_view bytes) {
  std::vector<RawExceptionEntry> entries;
  size_t i = 0;
  auto read = [&](bool row_start) -> unsigned {
    KILN_CHECK(i < bytes.size()) << "truncated exception table";
    auto byte = static_cast<unsigned char>(bytes[i]);
    KILN_CHECK(((byte & kRowStart) != 0) == row_start)
        << "malformed exception table: row-start bit wrong at byte " << i;
    unsigned value = byte & kChunkMask;
    while (byte & kContinue) {
      ++i;
      KILN_CHECK(i < bytes.size()) << "truncated exception table varint";
      byte = static_cast<unsigned char>(bytes[i]);
      KILN_CHECK((byte & kRowStart) == 0) << "malformed exception table at byte " << i;
      value = (value << kChunkBits) | (byte & kChunkMask);
    }
    ++i;
    return value;
  };
  while (i < bytes.size()) {
    RawExceptionEntry e;
    e.start = static_cast<int>(read(true));
    e.size = static_cast<int>(read(false));
    e.target = static_cast<int>(read(false));
    unsigned depth_lasti = read(false);
    e.depth = static_cast<int>(depth_lasti >> 1);
    e.lasti = depth_lasti & 1;
    entries.push_back(e);
  }
  return entries;
}

}  // namespace kiln::bytecode
