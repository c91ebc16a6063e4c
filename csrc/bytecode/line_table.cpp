// co_linetable (3.11+, "locations table"): a sequence of entries, each covering 1-8 code units.
// Header byte 0x80 | code << 3 | (units - 1); the code picks the form:
//   0-9   short:    same line; column = code*8 + (next byte >> 4), end column = column + (next & 15)
//   10-12 one line: line += code - 10; column and end column as plain bytes
//   13    no column: line += signed varint
//   14    long:     line += signed varint; end_line = line + varint; column + 1, end column + 1 as varints
//   15    none:     no location (line state unchanged)
// The encoder picks forms exactly as CPython's assembler does so that rebuilt tables are byte-equal.
#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::bytecode {

namespace {
constexpr unsigned char kEntryStart = 0x80;
constexpr unsigned char kContinue = 0x40;
constexpr int kMaxUnitsPerEntry = 8;
enum FormCode : int {
  kShortFormLast = 9,
  kOneLineForm0 = 10,
  kOneLineForm2 = 12,
  kNoColumnForm = 13,
  kLongForm = 14,
  kNoLocationForm = 15
};

void append_header(std::string& out, int code, int units) {
  out.push_back(static_cast<char>(kEntryStart | (code << 3) | (units - 1)));
}
}  // namespace

void append_line_varint(std::string& out, unsigned value) {
  while (value >= 64) {
    out.push_back(static_cast<char>(kContinue | (value & 63)));
    value >>= 6;
  }
  out.push_back(static_cast<char>(value));
}

void append_line_signed_varint(std::string& out, int value) {
  if (value < 0)
    append_line_varint(out, (static_cast<unsigned>(-value) << 1) | 1u);
  else
    append_line_varint(out, static_cast<unsigned>(value) << 1);
}

std::vector<Positions> decode_line_table(std::string_view bytes, int firstlineno, int code_units) {
  std::vector<Positions> out;
  out.reserve(code_units);
  size_t i = 0;
  auto next_byte = [&]() -> unsigned {
    KILN_CHECK(i < bytes.size()) << "truncated line table";
    return static_cast<unsigned char>(bytes[i++]);
  };
  auto varint = [&]() -> unsigned {
    unsigned b = next_byte(), value = b & 63, shift = 0;
    while (b & kContinue) {
      b = next_byte();
      shift += 6;
      value |= (b & 63) << shift;
    }
    return value;
  };
  auto signed_varint = [&]() -> int {
    unsigned v = varint();
    return (v & 1) ? -static_cast<int>(v >> 1) : static_cast<int>(v >> 1);
  };
  int line = firstlineno;
  while (i < bytes.size()) {
    unsigned header = next_byte();
    KILN_CHECK(header & kEntryStart) << "malformed line table: no entry start at byte " << (i - 1);
    int code = (header >> 3) & 15;
    int units = (header & 7) + 1;
    Positions p;
    if (code <= kShortFormLast) {
      unsigned second = next_byte();
      p.line = p.end_line = line;
      p.col = code * 8 + ((second >> 4) & 7);
      p.end_col = p.col + (second & 15);
    } else if (code <= kOneLineForm2) {
      line += code - kOneLineForm0;
      p.line = p.end_line = line;
      p.col = static_cast<int>(next_byte());
      p.end_col = static_cast<int>(next_byte());
    } else if (code == kNoColumnForm) {
      line += signed_varint();
      p.line = p.end_line = line;
    } else if (code == kLongForm) {
      line += signed_varint();
      p.line = line;
      p.end_line = line + static_cast<int>(varint());
      p.col = static_cast<int>(varint()) - 1;
      p.end_col = static_cast<int>(varint()) - 1;
    }  // kNoLocationForm: all -1, line state unchanged
    for (int u = 0; u < units; ++u) out.push_back(p);
  }
  // A table shorter than the code (hand-made code objects, `replace(co_linetable=b"")`) leaves the
  // rest without location, as co_positions() reports it.
  out.resize(code_units);
  return out;
}

namespace {
// One entry of at most 8 units, in the form CPython's assembler would choose; updates `line`.
void append_entry(std::string& out, const Positions& p, int units, int& line) {
  if (p.line < 0) {
    append_header(out, kNoLocationForm, units);
    return;
  }
  int line_delta = p.line - line;
  if (p.col < 0 || p.end_col < 0) {
    if (p.end_line == p.line || p.end_line == -1) {
      append_header(out, kNoColumnForm, units);
      append_line_signed_varint(out, line_delta);
      line = p.line;
      return;
    }
  } else if (p.end_line == p.line) {
    if (line_delta == 0 && p.col < 80 && p.end_col - p.col < 16 && p.end_col >= p.col) {
      append_header(out, p.col / 8, units);
      out.push_back(static_cast<char>(((p.col % 8) << 4) | (p.end_col - p.col)));
      return;
    }
    if (line_delta >= 0 && line_delta < 3 && p.col < 128 && p.end_col < 128) {
      append_header(out, kOneLineForm0 + line_delta, units);
      out.push_back(static_cast<char>(p.col));
      out.push_back(static_cast<char>(p.end_col));
      line = p.line;
      return;
    }
  }
  append_header(out, kLongForm, units);
  append_line_signed_varint(out, line_delta);
  append_line_varint(out, static_cast<unsigned>(p.end_line - p.line));
  append_line_varint(out, static_cast<unsigned>(p.col + 1));
  append_line_varint(out, static_cast<unsigned>(p.end_col + 1));
  line = p.line;
}
}  // namespace

std::string encode_line_table(const std::vector<LocationRun>& runs, int firstlineno) {
  std::string out;
  int line = firstlineno;
  for (const LocationRun& run : runs) {
    int units = run.units;
    while (units > kMaxUnitsPerEntry) {
      append_entry(out, run.pos, kMaxUnitsPerEntry, line);
      units -= kMaxUnitsPerEntry;
    }
    if (units > 0) append_entry(out, run.pos, units, line);
  }
  return out;
}

}  // namespace kiln::bytecode
