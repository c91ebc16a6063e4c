// OpcodeTable: the running interpreter's opcode numbers and properties, read once from the `opcode`
// and `dis` modules. 3.13 renumbers every opcode and each minor version changes cache counts, so
// nothing here is a hard-coded number; only opcode *names* with version-independent meaning appear.
#include <cstdio>
#include <cstring>
#include <string>

#include "bytecode/bytecode.h"
#include "common/error.h"

namespace kiln::bytecode {
namespace {

// Owned reference that releases itself; keeps the table builder free of Py_DECREF bookkeeping.
struct Ref {
  PyObject* p = nullptr;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  explicit operator bool() const { return p != nullptr; }
};

std::string take_python_error() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string text = "unknown error";
  if (value) {
    Ref s(PyObject_Str(value));
    if (s && PyUnicode_Check(s.p)) text = PyUnicode_AsUTF8(s.p);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
  return text;
}

PyObject* required_attr(PyObject* module, const char* name) {
  PyObject* v = PyObject_GetAttrString(module, name);
  KILN_ASSERT(v) << "opcode table: missing attribute " << name << ": " << take_python_error();
  return v;
}

// Opcode numbers in a list attribute such as opcode.hasjrel (pseudo-ops >= 256 are skipped).
template <typename F>
void for_each_listed(PyObject* module, const char* attr, F&& f) {
  Ref list(PyObject_GetAttrString(module, attr));
  if (!list) {
    PyErr_Clear();  // absent in this version (hasjump before 3.13, hasarg before 3.12)
    return;
  }
  Ref it(PyObject_GetIter(list.p));
  KILN_ASSERT(it) << "opcode." << attr << " is not iterable";
  while (PyObject* item = PyIter_Next(it.p)) {
    long op = PyLong_AsLong(item);
    Py_DECREF(item);
    if (op >= 0 && op < OpcodeTable::kCount) f(static_cast<int>(op));
  }
  PyErr_Clear();
}

// Instructions after which execution never continues with the next one (by name, version-neutral).
constexpr const char* kTerminators[] = {
    "RETURN_VALUE", "RETURN_CONST",      "RAISE_VARARGS",          "RERAISE",
    "JUMP_FORWARD", "JUMP_BACKWARD",     "JUMP_BACKWARD_NO_INTERRUPT",
};

const char* kInstrumentedPrefix = "INSTRUMENTED_";

// Effects the interpreter's table gets wrong for our purpose: 3.11 reports 0 for RETURN_GENERATOR,
// but the generator's first resume pushes the sent value that the following POP_TOP removes.
struct EffectOverride {
  const char* name;
  int fallthrough_effect;
};
constexpr EffectOverride kEffectOverrides[] = {{"RETURN_GENERATOR", 1}};

void build(OpcodeTable& t) {
  Ref opcode_mod(PyImport_ImportModule("opcode"));
  KILN_ASSERT(opcode_mod) << "cannot import opcode: " << take_python_error();
  Ref dis_mod(PyImport_ImportModule("dis"));
  KILN_ASSERT(dis_mod) << "cannot import dis: " << take_python_error();
  PyObject* om = opcode_mod.p;

  // Base opcodes: opcode.opmap (name -> number).
  Ref opmap(required_attr(om, "opmap"));
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(opmap.p, &pos, &key, &value)) {
    long op = PyLong_AsLong(value);
    if (op < 0 || op >= OpcodeTable::kCount) continue;  // pseudo-ops (JUMP, SETUP_*) never reach co_code
    std::string name = PyUnicode_AsUTF8(key);
    t.names[op] = name;
    t.infos[op].base = static_cast<int>(op);
    t.by_name[name] = static_cast<int>(op);
  }
  for (int op = 0; op < OpcodeTable::kCount; ++op)
    if (!t.names[op].empty()) t.infos[op].name = t.names[op].c_str();

  // Specialised opcodes -> base (dis._all_opmap numbers them; opcode._specializations groups them).
  // co_code is already de-specialised, so this is only a safety net for adaptive code arrays.
  Ref all_opmap(PyObject_GetAttrString(dis_mod.p, "_all_opmap"));
  Ref specializations(PyObject_GetAttrString(om, "_specializations"));
  PyErr_Clear();
  if (all_opmap && specializations && PyDict_Check(all_opmap.p) && PyDict_Check(specializations.p)) {
    pos = 0;
    while (PyDict_Next(specializations.p, &pos, &key, &value)) {
      auto base_it = t.by_name.find(PyUnicode_AsUTF8(key));
      if (base_it == t.by_name.end()) continue;
      Ref it(PyObject_GetIter(value));
      if (!it) {
        PyErr_Clear();
        continue;
      }
      while (PyObject* spec_name = PyIter_Next(it.p)) {
        PyObject* num = PyDict_GetItem(all_opmap.p, spec_name);  // borrowed
        Py_DECREF(spec_name);
        long op = num ? PyLong_AsLong(num) : -1;
        if (op >= 0 && op < OpcodeTable::kCount && t.infos[op].base < 0) t.infos[op].base = base_it->second;
      }
      PyErr_Clear();
    }
  }
  // Instrumented opcodes (3.12+, sys.monitoring) -> the opcode they wrap.
  for (int op = 0; op < OpcodeTable::kCount; ++op) {
    const std::string& name = t.names[op];
    if (name.rfind(kInstrumentedPrefix, 0) != 0) continue;
    auto it = t.by_name.find(name.substr(std::strlen(kInstrumentedPrefix)));
    if (it != t.by_name.end()) t.infos[op].base = it->second;
  }

  // Inline cache counts: a list by opcode (3.11, 3.12) or a dict by name (3.13).
  Ref cache_entries(required_attr(om, "_inline_cache_entries"));
  if (PyDict_Check(cache_entries.p)) {
    pos = 0;
    while (PyDict_Next(cache_entries.p, &pos, &key, &value)) {
      int op = -1;
      if (PyUnicode_Check(key)) {
        auto it = t.by_name.find(PyUnicode_AsUTF8(key));
        if (it != t.by_name.end()) op = it->second;
      } else if (PyLong_Check(key)) {
        op = static_cast<int>(PyLong_AsLong(key));
      }
      if (op >= 0 && op < OpcodeTable::kCount) t.infos[op].caches = static_cast<int>(PyLong_AsLong(value));
    }
  } else {
    Py_ssize_t n = PySequence_Size(cache_entries.p);
    for (Py_ssize_t op = 0; op < n && op < OpcodeTable::kCount; ++op) {
      Ref v(PySequence_GetItem(cache_entries.p, op));
      t.infos[op].caches = static_cast<int>(PyLong_AsLong(v.p));
    }
  }
  PyErr_Clear();

  // Argument: opcode.hasarg where it exists (3.12+), else the HAVE_ARGUMENT threshold.
  Ref has_arg_list(PyObject_GetAttrString(om, "hasarg"));
  PyErr_Clear();
  if (has_arg_list) {
    for_each_listed(om, "hasarg", [&](int op) { t.infos[op].has_arg = true; });
  } else {
    Ref have_argument(required_attr(om, "HAVE_ARGUMENT"));
    long threshold = PyLong_AsLong(have_argument.p);
    for (int op = 0; op < OpcodeTable::kCount; ++op) t.infos[op].has_arg = op >= threshold;
  }
  for (const char* list : {"hasjrel", "hasjabs", "hasjump"})
    for_each_listed(om, list, [&](int op) { t.infos[op].is_jump = true; });
  for_each_listed(om, "hasconst", [&](int op) { t.infos[op].has_const = true; });
  for_each_listed(om, "hasname", [&](int op) { t.infos[op].has_name = true; });
  for_each_listed(om, "haslocal", [&](int op) { t.infos[op].has_local = true; });
  for_each_listed(om, "hasfree", [&](int op) { t.infos[op].has_free = true; });

  for (int op = 0; op < OpcodeTable::kCount; ++op)
    t.infos[op].is_backward_jump = t.infos[op].is_jump && t.names[op].find("BACKWARD") != std::string::npos;
  for (const char* name : kTerminators) {
    int op = t.op(name);
    if (op >= 0) t.infos[op].is_terminator = true;
  }

  // Specialised/instrumented numbers take their base's properties (their own names stay "<N>"-free).
  for (int op = 0; op < OpcodeTable::kCount; ++op) {
    OpcodeTable::Info& info = t.infos[op];
    if (info.base >= 0 && info.base != op) {
      const char* own_name = info.name;
      int base = info.base;
      info = t.infos[base];
      info.base = base;
      info.name = own_name ? own_name : t.infos[base].name;
    }
  }

  Ref extended_arg(required_attr(om, "EXTENDED_ARG"));
  t.extended_arg = static_cast<int>(PyLong_AsLong(extended_arg.p));
  t.cache = t.op("CACHE");
  t.nop = t.op("NOP");
  t.fallthrough_effect_override.fill(OpcodeTable::kNoOverride);
  for (const EffectOverride& o : kEffectOverrides)
    if (int op = t.op(o.name); op >= 0) t.fallthrough_effect_override[op] = o.fallthrough_effect;
  KILN_ASSERT(t.extended_arg > 0 && t.cache >= 0 && t.nop >= 0) << "incomplete opcode table";
}

}  // namespace

int OpcodeTable::op(std::string_view name) const {
  auto it = by_name.find(std::string(name));
  return it == by_name.end() ? -1 : it->second;
}

const char* OpcodeTable::name(int op) const {
  static const std::array<std::array<char, 8>, kCount> unknown_names = [] {
    std::array<std::array<char, 8>, kCount> a{};
    for (int i = 0; i < kCount; ++i) std::snprintf(a[i].data(), a[i].size(), "<%d>", i);
    return a;
  }();
  if (op < 0 || op >= kCount) return "<invalid>";
  return infos[op].name ? infos[op].name : unknown_names[op].data();
}

const OpcodeTable::Info& OpcodeTable::info(int op) const {
  KILN_ASSERT(op >= 0 && op < kCount) << "opcode " << op << " out of range";
  return infos[op];
}


int OpcodeTable::stack_effect(int op, int arg, bool jump) const {
  if (!jump && fallthrough_effect_override[base(op)] != kNoOverride) return fallthrough_effect_override[base(op)];
  int effect = PyCompile_OpcodeStackEffectWithJump(base(op), has_arg(op) ? arg : 0, jump ? 1 : 0);
  // CPython reports an invalid opcode/arg as PY_INVALID_STACK_EFFECT (INT_MAX) with ValueError set.
  if (PyErr_Occurred()) PyErr_Clear();
  KILN_CHECK(effect > -1000 && effect < 1000) << "no stack effect for " << name(op) << " " << arg;
  return effect;
}

const OpcodeTable& opcodes() {
  // A function-local static is initialised once even if several threads race here (under the GIL
  // only one of them runs Python at a time, and the build holds the GIL throughout).
  // Built in place and never freed: Info::name points into `names`, so the table must not move.
  static const OpcodeTable* table = [] {
    auto* t = new OpcodeTable();
    build(*t);
    return t;
  }();
  return *table;
}

}  // namespace kiln::bytecode
