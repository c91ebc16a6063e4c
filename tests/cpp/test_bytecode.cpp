// kiln::bytecode's table encodings and assembler, checked against the embedded CPython.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "bytecode/bytecode.h"
#include "common/error.h"
#include "python_env.h"

namespace bc = kiln::bytecode;
using kiln::testing::ensure_python;
using kiln::testing::run_and_get;

namespace {

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

std::string py_bytes(PyObject* obj) {
  REQUIRE(PyBytes_Check(obj));
  return std::string(PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj));
}

std::string code_attr(PyObject* code, const char* name) {
  PyObject* v = PyObject_GetAttrString(code, name);
  REQUIRE(v);
  std::string out = py_bytes(v);
  Py_DECREF(v);
  return out;
}

// Code object of the function `name` defined by `source`.
PyObject* function_code(const std::string& source, const char* name) {
  PyObject* fn = run_and_get(source, name);
  PyObject* code = PyObject_GetAttrString(fn, "__code__");
  Py_DECREF(fn);
  REQUIRE(code);
  return code;
}

const char* kTrySource = R"(
def f(x):
    try:
        y = 1 / x
    except ZeroDivisionError:
        y = None
    finally:
        x = 0
    with open(__file__) if False else nothing() as z:
        pass
    return y
)";

}  // namespace

TEST_CASE("exception table varints match the documented example") {
  // (start 20, size 8, target 100, depth 3, lasti 0): 0x80|20, 8, 100 = 1<<6 | 36, (3<<1)|0.
  std::string encoded = bc::encode_exception_table({{20, 8, 100, 3, false}});
  CHECK(encoded == bytes({0x94, 0x08, 0x41, 0x24, 0x06}));
  auto decoded = bc::decode_exception_table(encoded);
  REQUIRE(decoded.size() == 1);
  CHECK(decoded[0] == bc::RawExceptionEntry{20, 8, 100, 3, false});

  // Values of every chunk count round-trip, lasti included.
  std::vector<bc::RawExceptionEntry> big = {{0, 1, 63, 0, true}, {64, 4095, 4096, 262143, false},
                                            {(1 << 24) + 5, 1 << 18, (1 << 29) + 1, 7, true}};
  CHECK(bc::decode_exception_table(bc::encode_exception_table(big)) == big);
  CHECK_THROWS_AS(bc::decode_exception_table(bytes({0x14, 0x08})), kiln::Error);  // no row-start bit
}

TEST_CASE("exception table decoding agrees with CPython's own parser and re-encodes byte-equal") {
  ensure_python();
  PyObject* code = function_code(kTrySource, "f");
  std::string table = code_attr(code, "co_exceptiontable");
  REQUIRE(!table.empty());
  auto ours = bc::decode_exception_table(table);
  CHECK(bc::encode_exception_table(ours) == table);

  // dis._parse_exception_table reports byte offsets: start, end (exclusive), target, depth, lasti.
  PyObject* dis = PyImport_ImportModule("dis");
  REQUIRE(dis);
  PyObject* parsed = PyObject_CallMethod(dis, "_parse_exception_table", "O", code);
  REQUIRE(parsed);
  REQUIRE(PyList_Size(parsed) == static_cast<Py_ssize_t>(ours.size()));
  for (size_t i = 0; i < ours.size(); ++i) {
    PyObject* entry = PyList_GetItem(parsed, i);
    auto field = [&](const char* name) {
      PyObject* v = PyObject_GetAttrString(entry, name);
      long out = PyLong_AsLong(v);
      Py_DECREF(v);
      return out;
    };
    CHECK(field("start") == 2 * ours[i].start);
    CHECK(field("end") == 2 * (ours[i].start + ours[i].size));
    CHECK(field("target") == 2 * ours[i].target);
    CHECK(field("depth") == ours[i].depth);
    CHECK(field("lasti") == (ours[i].lasti ? 1 : 0));
  }
  Py_DECREF(parsed);
  Py_DECREF(dis);
  Py_DECREF(code);
}

TEST_CASE("line table varints are 6-bit chunks, least significant first, signed by the low bit") {
  auto varint = [](unsigned v) {
    std::string s;
    bc::append_line_varint(s, v);
    return s;
  };
  auto signed_varint = [](int v) {
    std::string s;
    bc::append_line_signed_varint(s, v);
    return s;
  };
  CHECK(varint(0) == bytes({0x00}));
  CHECK(varint(63) == bytes({0x3f}));
  CHECK(varint(64) == bytes({0x40, 0x01}));
  CHECK(varint(4095) == bytes({0x7f, 0x3f}));
  CHECK(varint(4096) == bytes({0x40, 0x40, 0x01}));
  CHECK(signed_varint(0) == bytes({0x00}));
  CHECK(signed_varint(1) == bytes({0x02}));
  CHECK(signed_varint(-1) == bytes({0x03}));
  CHECK(signed_varint(-32) == bytes({0x41, 0x01}));  // (32 << 1) | 1 = 65 = 1 + 1 * 64
  CHECK(signed_varint(40) == bytes({0x50, 0x01}));   // 80 = 16 + 1 * 64
}

TEST_CASE("line table forms decode like co_positions() and re-encode byte-equal") {
  ensure_python();
  // Short form (same line, narrow columns), one-line form (next lines) and long form (multi-line
  // expression, wide column) occur here; 3.12+ adds no-location entries.
  // Column 130 forces the long form (one-line form columns stop at 127).
  std::string source = "def g(a, b):\n    x = a + b\n    y = (a +\n         b)\n    z = (" + std::string(130, ' ') +
           "a)\n    if x:\n        pass\n    return [i for i in range(3)]\n";
  PyObject* code = function_code(source, "g");
  std::string table = code_attr(code, "co_linetable");
  int units = static_cast<int>(code_attr(code, "co_code").size() / 2);
  PyObject* firstline = PyObject_GetAttrString(code, "co_firstlineno");
  int firstlineno = static_cast<int>(PyLong_AsLong(firstline));
  Py_DECREF(firstline);

  std::vector<bc::Positions> ours = bc::decode_line_table(table, firstlineno, units);
  PyObject* positions = PyObject_CallMethod(code, "co_positions", nullptr);
  PyObject* list = PySequence_List(positions);
  REQUIRE(PyList_Size(list) == units);
  auto or_none = [](PyObject* v) { return v == Py_None ? -1 : static_cast<int>(PyLong_AsLong(v)); };
  for (int u = 0; u < units; ++u) {
    PyObject* t = PyList_GetItem(list, u);
    bc::Positions expected{or_none(PyTuple_GetItem(t, 0)), or_none(PyTuple_GetItem(t, 1)),
                           or_none(PyTuple_GetItem(t, 2)), or_none(PyTuple_GetItem(t, 3))};
    INFO("code unit " << u);
    CHECK(ours[u] == expected);
  }
  bool saw_wide_column = false;
  for (const bc::Positions& p : ours) saw_wide_column |= p.col >= 128;
  CHECK(saw_wide_column);

  bc::CodeInstructions ci = bc::decode(reinterpret_cast<PyCodeObject*>(code));
  CHECK(bc::assemble(ci, ci.firstlineno).line_table == table);
  Py_DECREF(list);
  Py_DECREF(positions);
  Py_DECREF(code);
}

TEST_CASE("every line table form encodes and decodes back, runs split at 8 code units") {
  const int first = 10;
  std::vector<bc::LocationRun> runs = {
      {{10, 10, 4, 9}, 3},      // short form: same line, column < 80, width < 16
      {{12, 12, 100, 120}, 2},  // one-line form, line + 2
      {{12, 12, -1, -1}, 1},    // no-column form
      {{9, 11, 0, 200}, 11},    // long form (line goes back, spans lines), 11 units -> 8 + 3
      {{-1, -1, -1, -1}, 2},    // no location
      {{40, 40, 2, 3}, 1},      // columns known but line + 31: long form
  };
  std::string table = bc::encode_line_table(runs, first);
  // Header bytes: short code 0 (col 4 / 8 = 0), len 3 -> 0x80 | 0 << 3 | 2.
  CHECK(static_cast<unsigned char>(table[0]) == 0x82);
  CHECK(static_cast<unsigned char>(table[1]) == ((4 << 4) | 5));
  CHECK(static_cast<unsigned char>(table[2]) == (0x80 | 12 << 3 | 1));  // one-line, line + 2, 2 units
  std::vector<bc::Positions> decoded = bc::decode_line_table(table, first, 20);
  std::vector<bc::Positions> expected;
  for (const bc::LocationRun& run : runs)
    for (int u = 0; u < run.units; ++u) expected.push_back(run.pos);
  REQUIRE(decoded.size() == expected.size());
  for (size_t u = 0; u < expected.size(); ++u) {
    INFO("code unit " << u);
    CHECK(decoded[u] == expected[u]);
  }
  // Units past the end of the table have no location (CPython's co_positions() says the same).
  std::vector<bc::Positions> longer = bc::decode_line_table(table, first, 22);
  CHECK(longer[21] == bc::Positions{});
  CHECK(longer[19] == expected[19]);
  CHECK_THROWS_AS(bc::decode_line_table(bytes({0x7f}), first, 1), kiln::Error);  // no entry-start bit
}

TEST_CASE("decode/assemble round-trips a function byte for byte") {
  ensure_python();
  PyObject* code = function_code(
      "def nothing():\n    import contextlib\n    return contextlib.nullcontext()\n" + std::string(kTrySource), "f");
  bc::CodeInstructions ci = bc::decode(reinterpret_cast<PyCodeObject*>(code));
  bc::Assembled a = bc::assemble(ci, ci.firstlineno);
  CHECK(a.code == code_attr(code, "co_code"));
  CHECK(a.exception_table == code_attr(code, "co_exceptiontable"));
  CHECK(a.line_table == code_attr(code, "co_linetable"));
  PyObject* stacksize = PyObject_GetAttrString(code, "co_stacksize");
  CHECK(a.stacksize == PyLong_AsLong(stacksize));
  Py_DECREF(stacksize);
  CHECK(!bc::format(ci).empty());
  Py_DECREF(code);
}

TEST_CASE("EXTENDED_ARG prefixes are laid out to a fixpoint") {
  ensure_python();
  const bc::OpcodeTable& ops = bc::opcodes();
  const int nop = ops.op("NOP"), jump_forward = ops.op("JUMP_FORWARD"), jump_backward = ops.op("JUMP_BACKWARD");
  const int load_const = ops.op("LOAD_CONST"), return_value = ops.op("RETURN_VALUE");
  REQUIRE(nop >= 0);
  REQUIRE(jump_forward >= 0);
  REQUIRE(jump_backward >= 0);
  auto instr = [](int opcode, int arg = 0, int target = -1) {
    bc::Instruction i;
    i.opcode = opcode;
    i.arg = arg;
    i.target = target;
    return i;
  };
  auto unit = [](const std::string& code, int u) {
    return std::make_pair(static_cast<int>(static_cast<unsigned char>(code[2 * u])),
                          static_cast<int>(static_cast<unsigned char>(code[2 * u + 1])));
  };
  auto nops_then_return = [&](bc::CodeInstructions& ci, int count) {
    for (int k = 0; k < count; ++k) ci.instructions.push_back(instr(nop));
    ci.instructions.push_back(instr(load_const, 0));
    ci.instructions.push_back(instr(return_value));
  };

  SECTION("a forward jump over 255 units needs no prefix, over 256 it does") {
    for (int distance : {255, 256}) {
      bc::CodeInstructions ci;
      ci.instructions.push_back(instr(jump_forward, 0, distance + 1));
      nops_then_return(ci, distance);
      std::string code = bc::assemble(ci, 1).code;
      if (distance == 255) {
        CHECK(unit(code, 0) == std::make_pair(jump_forward, 255));
      } else {
        CHECK(unit(code, 0) == std::make_pair(ops.extended_arg, 1));
        CHECK(unit(code, 1) == std::make_pair(jump_forward, 0));
      }
    }
  }

  SECTION("one jump's prefix pushes another jump over the limit") {
    // A jumps over 254 NOPs and B, landing just after B; B jumps over 256 NOPs. With B unprefixed
    // A's distance is 255; B needs a prefix (256), which makes A's distance 256, so A needs one too.
    bc::CodeInstructions ci;
    ci.instructions.push_back(instr(jump_forward, 0, 1 + 254 + 1));  // A -> the NOP after B
    for (int k = 0; k < 254; ++k) ci.instructions.push_back(instr(nop));
    ci.instructions.push_back(instr(jump_forward, 0, 1 + 254 + 1 + 256));  // B -> LOAD_CONST
    nops_then_return(ci, 256);
    std::string code = bc::assemble(ci, 1).code;
    CHECK(unit(code, 0) == std::make_pair(ops.extended_arg, 1));
    CHECK(unit(code, 1) == std::make_pair(jump_forward, 0));  // 256 = 0x100
    const int b = 2 + 254;
    CHECK(unit(code, b) == std::make_pair(ops.extended_arg, 1));
    CHECK(unit(code, b + 1) == std::make_pair(jump_forward, 0));
  }

  SECTION("a backward jump's own prefix lengthens its distance") {
    const int caches = ops.caches(jump_backward);
    for (int extra : {0, 1}) {
      // Distance from the end of JUMP_BACKWARD (after its caches) back to instruction 0.
      const int nops = 254 - caches + extra;
      bc::CodeInstructions ci;
      for (int k = 0; k < nops; ++k) ci.instructions.push_back(instr(nop));
      ci.instructions.push_back(instr(jump_backward, 0, 0));
      std::string code = bc::assemble(ci, 1).code;
      if (extra == 0) {
        CHECK(unit(code, nops) == std::make_pair(jump_backward, 255));
      } else {
        // 256 without a prefix, so it gets one, and the prefix itself adds one unit: 257.
        CHECK(unit(code, nops) == std::make_pair(ops.extended_arg, 1));
        CHECK(unit(code, nops + 1) == std::make_pair(jump_backward, 1));
      }
      CHECK(static_cast<int>(code.size()) / 2 == nops + 1 + extra + caches);
    }
  }

  SECTION("arguments above 16 bits get two and three prefixes") {
    bc::CodeInstructions ci;
    ci.instructions.push_back(instr(load_const, 0x012345));
    ci.instructions.push_back(instr(load_const, 0x01234567));
    ci.instructions.push_back(instr(return_value));
    std::string code = bc::assemble(ci, 1).code;
    CHECK(unit(code, 0) == std::make_pair(ops.extended_arg, 0x01));
    CHECK(unit(code, 1) == std::make_pair(ops.extended_arg, 0x23));
    CHECK(unit(code, 2) == std::make_pair(load_const, 0x45));
    CHECK(unit(code, 3) == std::make_pair(ops.extended_arg, 0x01));
    CHECK(unit(code, 6) == std::make_pair(load_const, 0x67));
  }

  SECTION("a jump in the wrong direction is refused") {
    bc::CodeInstructions ci;
    ci.instructions.push_back(instr(nop));
    ci.instructions.push_back(instr(jump_forward, 0, 0));
    CHECK_THROWS_WITH(bc::assemble(ci, 1), Catch::Contains("forward jump must go forward"));
  }
}

TEST_CASE("opcode table comes from the running interpreter") {
  ensure_python();
  const bc::OpcodeTable& ops = bc::opcodes();
  PyObject* opcode = PyImport_ImportModule("opcode");
  REQUIRE(opcode);
  PyObject* opmap = PyObject_GetAttrString(opcode, "opmap");
  for (const char* name : {"LOAD_FAST", "STORE_FAST", "FOR_ITER", "JUMP_BACKWARD", "RETURN_VALUE"}) {
    INFO(name);
    CHECK(ops.op(name) == PyLong_AsLong(PyDict_GetItemString(opmap, name)));
    CHECK(std::string(ops.name(ops.op(name))) == name);
  }
  CHECK(ops.op("NO_SUCH_OPCODE") == -1);
  CHECK(ops.is_backward_jump(ops.op("JUMP_BACKWARD")));
  CHECK_FALSE(ops.is_backward_jump(ops.op("FOR_ITER")));
  CHECK(ops.is_jump(ops.op("FOR_ITER")));
  CHECK(ops.is_terminator(ops.op("RETURN_VALUE")));
  CHECK_FALSE(ops.has_arg(ops.op("NOP")));
  CHECK(ops.has_local(ops.op("LOAD_FAST")));
  PyObject* ext = PyObject_GetAttrString(opcode, "EXTENDED_ARG");
  CHECK(ops.extended_arg == PyLong_AsLong(ext));
  Py_DECREF(ext);
  Py_DECREF(opmap);
  Py_DECREF(opcode);
}
