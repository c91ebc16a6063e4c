// Calls while tracing, continued: the Python constructs real models use (dict mutation and construction,
// functools.partial, ContextVar pairs, inspect.signature of pinned functions, Python-written mappings).
#include <algorithm>
#include <string_view>

#include "common/error.h"
#include "common/log.h"
#include "trace/call_helpers.h"
#include "trace/interpreter.h"
#include "trace/traced_raise.h"
#include "trace/tracer.h"
#include "trace/tracer_helpers.h"

namespace kiln::trace {

using namespace calls;

// ---- Python constructs of real models ------------------------------------------------------------------

namespace {

long find_key(const VarPtr& dict, PyObject* key) {
  for (size_t i = 0; i < dict->keys.size(); ++i) {
    int eq = PyObject_RichCompareBool(dict->keys[i], key, Py_EQ);
    if (eq < 0) PyErr_Clear();
    if (eq == 1) return (long)i;
  }
  return -1;
}

void store_key(const VarPtr& dict, const VarPtr& key, const VarPtr& value) {
  if (!key->is(VarKind::kConst) || key->by_type) KILN_UNSUPPORTED() << "dict key that is a " << key->describe();
  if (PyObject_Hash(key->value) == -1) {
    PyErr_Clear();
    KILN_UNSUPPORTED() << "unhashable dict key " << key->describe();
  }
  long i = find_key(dict, key->value);
  if (i >= 0) {
    dict->items[i] = value;
    return;
  }
  dict->keys.push_back(Py_NewRef(key->value));
  dict->items.push_back(value);
}

bool all_constant(const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  for (const VarPtr& a : args)
    if (!is_constant(a) || holds_object_pinned_by_type(a)) return false;
  for (const auto& kv : kwargs)
    if (!is_constant(kv.second) || holds_object_pinned_by_type(kv.second)) return false;
  return true;
}

// The Python type a Var's value has at run time, known from what the trace guarded.
PyTypeObject* type_of(const VarPtr& v) {
  switch (v->kind) {
    case VarKind::kTensor:  // the tensor guard checks the exact type
    case VarKind::kObject:
    case VarKind::kUserObject: return v->real_type;
    case VarKind::kConst:   // pinned by identity, by value, or (by_type) by its type
    case VarKind::kModule:  // pinned by identity; its class is guarded in call_python_construct
    case VarKind::kFunction: return Py_TYPE(v->value);
    case VarKind::kTuple: return v->real_type ? v->real_type : &PyTuple_Type;
    case VarKind::kList: return v->real_type ? v->real_type : &PyList_Type;  // a ModuleList's slice
    case VarKind::kDict: return v->real_type ? v->real_type : &PyDict_Type;  // an OrderedDict made in the trace
    case VarKind::kSuper: return &PySuper_Type;
    default: KILN_UNSUPPORTED() << "type() of a " << v->describe();
  }
}

PyObject* lookup(const char* module, const char* name) {
  PyObject* m = PyImport_ImportModule(module);
  PyObject* f = m ? PyObject_GetAttrString(m, name) : nullptr;
  Py_XDECREF(m);
  if (!f) PyErr_Clear();
  return f;  // new reference, kept for the process
}

// Questions about who runs the code, answered at trace time as constants (Py_True / Py_False, borrowed), or nullptr
// for any other callable. "Is this being compiled" answers True, as under torch.compile: libraries then skip work
// that only eager needs (transformers skips its data-dependent all-ones mask checks). Exporting and TorchScript
// never run kiln's traces: False.
PyObject* who_runs_answer(PyObject* f) {
  // Only modules torch has imported anyway: importing torch._dynamo here would import sympy (a quarter second).
  static const std::vector<std::pair<PyObject*, PyObject*>> answers = {
      {lookup("torch.compiler", "is_compiling"), Py_True},     {lookup("torch.compiler", "is_dynamo_compiling"), Py_True},
      {lookup("torch._utils", "is_compiling"), Py_True},       {lookup("torch.compiler", "is_exporting"), Py_False},
      {lookup("torch.jit", "is_scripting"), Py_False},         {lookup("torch.jit", "is_tracing"), Py_False}};
  for (const auto& [predicate, answer] : answers)
    if (predicate && predicate == f) return answer;
  // torch._dynamo's own is_compiling (torch._dynamo.external_utils), if a library imported it.
  if (!PyFunction_Check(f)) return nullptr;
  PyObject* module = ((PyFunctionObject*)f)->func_module;
  const char* name = PyUnicode_AsUTF8(((PyFunctionObject*)f)->func_name);
  const bool dynamo_is_compiling = module && PyUnicode_Check(module) && name && std::string_view(name) == "is_compiling" &&
                                   std::string_view(PyUnicode_AsUTF8(module)).rfind("torch._dynamo", 0) == 0;
  return dynamo_is_compiling ? Py_True : nullptr;
}

// Queries of process state that take no arguments and whose answer can change between calls (a CUDA graph
// capture starts, a device becomes visible): answered at trace time and guarded by asking again on every call
// (Source::call), so a different answer recompiles instead of replaying a branch taken on a stale one.
bool guarded_query(PyObject* f) {
  static const std::vector<PyObject*> queries = {
      lookup("torch.cuda", "is_current_stream_capturing"), lookup("torch.cuda", "is_available"),
      lookup("torch.cuda", "device_count"), lookup("torch.cuda", "is_initialized"),
      lookup("torch", "are_deterministic_algorithms_enabled"), lookup("torch.xpu", "is_current_stream_capturing"),
  };
  for (PyObject* q : queries)
    if (q && q == f) return true;
  return false;
}

PyObject* partial_type() {
  static PyObject* type = lookup("functools", "partial");
  return type;
}

PyObject* inspect_signature() {
  static PyObject* fn = lookup("inspect", "signature");
  return fn;
}

PyObject* context_var_type() {
  static PyObject* type = lookup("contextvars", "ContextVar");
  return type;
}

}  // namespace

bool Tracer::claim_container(const VarPtr& v) {
  if (v->read_only) return false;
  if (!v->source) return true;
  if (v->is(VarKind::kList)) {
    // A list from the frame (`self.cache.layers.append(layer)`): the compiled frame puts the items the trace leaves
    // in it back into the very same list after the graph (stores.cpp). A ModuleList's slice is no list of the frame.
    if (!v->built_from || v->real_type) return false;
    record_store({v, v->built_from, Py_None, v, /*item=*/false, /*free_index=*/-1, /*contents=*/true});
    return true;
  }
  if (!v->is(VarKind::kDict)) return false;
  PyCodeObject* code = root_.code;
  const int varkeywords = code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & CO_VARARGS) ? 1 : 0);
  const bool kwargs = (code->co_flags & CO_VARKEYWORDS) && v->source->kind() == SourceKind::kLocal &&
                      v->source->index() == varkeywords;
  if (!kwargs) {
    // Any other dict from the frame (a cache's per-layer table, a config's dict): the trace changes its Var, and
    // the compiled frame writes the items it ends with back into the very same dict after the graph (stores.cpp).
    if (!v->built_from) return false;
    record_store({v, v->built_from, Py_None, v, /*item=*/false, /*free_index=*/-1, /*contents=*/true});
    return true;
  }
  // The root frame's **kwargs: made by the call for this frame alone. Once the trace changes it, outputs and
  // graph breaks rebuild it from its items (each re-read through its own source) instead of re-reading it.
  v->source = nullptr;
  return true;
}

VarPtr Tracer::mutate_dict(const VarPtr& self, const std::string& name, const std::vector<VarPtr>& args) {
  static const std::vector<std::string> mutations = {"pop",   "popitem",     "setdefault",  "update",
                                                     "clear", "__setitem__", "__delitem__", "move_to_end"};
  if (std::find(mutations.begin(), mutations.end(), name) == mutations.end()) return nullptr;
  if (!claim_container(self))
    KILN_UNSUPPORTED() << "dict." << name << " of a dict from outside the trace (the mutation would have to be replayed)";
  size_t n = args.size();
  auto key_of = [&](const VarPtr& key) {
    if (!key->is(VarKind::kConst)) KILN_UNSUPPORTED() << "dict key that is a " << key->describe();
    return find_key(self, key->value);
  };
  if ((name == "pop" && (n == 1 || n == 2)) || (name == "__delitem__" && n == 1)) {
    long i = key_of(args[0]);
    if (i < 0) {
      if (n == 2) return args[1];
      KILN_UNSUPPORTED() << "dict." << name << " of a missing key (KeyError in eager)";
    }
    VarPtr value = self->items[i];
    Py_DECREF(self->keys[i]);
    self->keys.erase(self->keys.begin() + i);
    self->items.erase(self->items.begin() + i);
    return name == "pop" ? value : make_const(Py_None);
  }
  if (name == "move_to_end" && (n == 1 || n == 2) && (n == 1 || args[1]->is(VarKind::kConst))) {  // OrderedDict's
    const long i = key_of(args[0]);
    if (i < 0) {
      PyErr_SetObject(PyExc_KeyError, args[0]->value);
      raise_pending("OrderedDict.move_to_end");
    }
    const bool last = n == 1 || PyObject_IsTrue(args[1]->value) == 1;
    PyObject* key = self->keys[i];
    VarPtr value = self->items[i];
    self->keys.erase(self->keys.begin() + i);
    self->items.erase(self->items.begin() + i);
    self->keys.insert(last ? self->keys.end() : self->keys.begin(), key);
    self->items.insert(last ? self->items.end() : self->items.begin(), value);
    return make_const(Py_None);
  }
  if (name == "popitem" && n == 0) {  // the last key inserted, as a (key, value) pair
    if (self->items.empty()) {
      PyErr_SetString(PyExc_KeyError, "popitem(): dictionary is empty");
      raise_pending("dict.popitem");
    }
    VarPtr pair = make_sequence(VarKind::kTuple, {make_const(self->keys.back()), self->items.back()});
    Py_DECREF(self->keys.back());
    self->keys.pop_back();
    self->items.pop_back();
    return pair;
  }
  if (name == "setdefault" && (n == 1 || n == 2)) {
    long i = key_of(args[0]);
    if (i >= 0) return self->items[i];
    store_key(self, args[0], n == 2 ? args[1] : make_const(Py_None));
    return self->items.back();
  }
  if (name == "__setitem__" && n == 2) {
    store_key(self, args[0], args[1]);
    return make_const(Py_None);
  }
  if (name == "update" && n == 1 && args[0]->is(VarKind::kDict)) {
    VarPtr other = args[0];
    std::vector<VarPtr> keys;  // copied first: `d.update(d)` reads what it writes
    for (PyObject* k : other->keys) keys.push_back(make_const(k));
    std::vector<VarPtr> values = other->items;
    for (size_t i = 0; i < keys.size(); ++i) store_key(self, keys[i], values[i]);
    return make_const(Py_None);
  }
  if (name == "clear" && n == 0) {
    for (PyObject* k : self->keys) Py_DECREF(k);
    self->keys.clear();
    self->items.clear();
    return make_const(Py_None);
  }
  KILN_UNSUPPORTED() << "dict." << name << " with " << n << " arguments";
}

void Tracer::refuse_unguarded_data(const VarPtr& v, PyObject* fn) {
  if (v->is(VarKind::kTuple) || v->is(VarKind::kList) || v->is(VarKind::kDict)) {
    for (const VarPtr& item : v->items) refuse_unguarded_data(item, fn);
    return;
  }
  if (!v->is(VarKind::kConst) || !v->by_type || !v->value) return;
  // Its guard checks the type, not the contents: data (a buffer or an __array__) cannot be read into the graph.
  if (PyObject_CheckBuffer(v->value) || PyObject_HasAttrString(v->value, "__array__") ||
      PyObject_HasAttrString(v->value, "__array_interface__"))
    KILN_UNSUPPORTED() << "passing a " << Py_TYPE(v->value)->tp_name << " to " << name_of(fn)
                       << " (its contents would be read once, at trace time; the call runs eagerly)";
}

VarPtr Tracer::iteration_builtin(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  // enumerate, zip and reversed over what the trace holds: lists of its items (a stateful iterator folded into a
  // constant would be consumed by the first call).
  if (f != builtin("enumerate") && f != builtin("zip") && f != builtin("reversed")) return nullptr;
  const size_t n = args.size();
  // enumerate(it), enumerate(it, k) or enumerate(it, start=k), with an int k.
  const VarPtr* enum_start = n == 2 && kwargs.empty() ? &args[1] : nullptr;
  // Keyword names come as the call made them: `f(**{b"k": 1})` passes a bytes one (a TypeError for the callee).
  const bool start_keyword = n == 1 && kwargs.size() == 1 && PyUnicode_Check(kwargs[0].first) &&
                             PyUnicode_CompareWithASCIIString(kwargs[0].first, "start") == 0;
  if (start_keyword) enum_start = &kwargs[0].second;
  if (f == builtin("enumerate") && (enum_start || (n == 1 && kwargs.empty())) &&
      (!enum_start || ((*enum_start)->is(VarKind::kConst) && PyLong_CheckExact((*enum_start)->value)))) {
    long long start = enum_start ? PyLong_AsLongLong((*enum_start)->value) : 0;
    std::vector<VarPtr> pairs;
    for (VarPtr& item : iterate(args[0]))
      pairs.push_back(make_sequence(VarKind::kTuple, {make_const_steal(PyLong_FromLongLong(start++)), item}));
    return make_sequence(VarKind::kList, std::move(pairs));
  }
  const bool zip_strict = f == builtin("zip") && kwargs.size() == 1 && PyUnicode_Check(kwargs[0].first) &&
                          PyUnicode_CompareWithASCIIString(kwargs[0].first, "strict") == 0 &&
                          kwargs[0].second->is(VarKind::kConst);
  if (f == builtin("zip") && (kwargs.empty() || zip_strict) && n >= 1) {
    std::vector<std::vector<VarPtr>> columns;
    size_t len = SIZE_MAX;
    for (const VarPtr& a : args) {
      columns.push_back(iterate(a));
      len = std::min(len, columns.back().size());
    }
    if (zip_strict && PyObject_IsTrue(kwargs[0].second->value) == 1)
      for (size_t i = 1; i < columns.size(); ++i)
        if (columns[i].size() != columns[0].size()) {
          const std::string others = i == 1 ? "argument 1" : "arguments 1-" + std::to_string(i);
          PyErr_Format(PyExc_ValueError, "zip() argument %zu is %s than %s", i + 1,
                       columns[i].size() > columns[0].size() ? "longer" : "shorter", others.c_str());
          raise_pending("zip(strict=True)");
        }
    std::vector<VarPtr> rows;
    for (size_t i = 0; i < len; ++i) {
      std::vector<VarPtr> row;
      for (auto& c : columns) row.push_back(c[i]);
      rows.push_back(make_sequence(VarKind::kTuple, std::move(row)));
    }
    return make_sequence(VarKind::kList, std::move(rows));
  }
  if (f == builtin("reversed") && n == 1 && kwargs.empty() && !is_constant(args[0])) {
    std::vector<VarPtr> items = iterate(args[0]);
    return make_sequence(VarKind::kList, std::vector<VarPtr>(items.rbegin(), items.rend()));
  }
  return nullptr;
}

VarPtr Tracer::update_dict_with_keywords(const VarPtr& self, std::vector<VarPtr> args, const KwArgs& kwargs) {
  // The positional mapping first, then the keywords, as eager applies them.
  for (const auto& kw : kwargs)
    if (!PyUnicode_Check(kw.first)) KILN_UNSUPPORTED() << "dict.update with a keyword that is not a string";
  if (!args.empty()) call_container_method(self, "dict.update", std::move(args));
  std::vector<PyObject*> keys;
  std::vector<VarPtr> values;
  for (const auto& [name, value] : kwargs) {
    keys.push_back(Py_NewRef(name));
    values.push_back(value);
  }
  return call_container_method(self, "dict.update", {make_dict(std::move(keys), std::move(values))});
}

VarPtr Tracer::call_environ_method(const VarPtr& self, const char* name, const std::vector<VarPtr>& args,
                                   const KwArgs& kwargs) {
  static PyObject* environ = lookup("os", "environ");
  if (!environ || self->value != environ || !self->is(VarKind::kConst) || !kwargs.empty()) return nullptr;
  const std::string_view method = name;
  const size_t n = args.size();
  const bool get = method == "get" && (n == 1 || n == 2), item = method == "__getitem__" && n == 1,
             contains = method == "__contains__" && n == 1;
  if (!(get || item || contains) || !args[0]->is(VarKind::kConst) || !PyUnicode_CheckExact(args[0]->value))
    return nullptr;
  const SourcePtr read = Source::mapping_get(Source::object(environ, "os.environ"), PyUnicode_AsUTF8(args[0]->value));
  PyObject* value = read->resolve_from(environ, SourceRoots{});
  if (!value) rethrow_python("os.environ.get");
  guards_->add_constant(read, value);
  VarPtr out;
  if (contains) out = make_const(value == Py_None ? Py_False : Py_True);
  else if (value != Py_None) out = make_const(value);
  else if (get) out = n == 2 ? args[1] : make_const(Py_None);
  Py_DECREF(value);
  if (!out) KILN_UNSUPPORTED() << "os.environ['" << PyUnicode_AsUTF8(args[0]->value) << "'] of a variable that is not set";
  return out;
}

// `t._replace(field=value, ...)` of a namedtuple the trace holds (a kTuple typed by its class): a new tuple of that
// class with those items replaced, as namedtuple's own _replace gives (its body reads cls._make, which the tracer
// does not follow). Null for anything else; a name that is no field is left to the real method (ValueError).
VarPtr Tracer::namedtuple_replace(const VarPtr& fn, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  if (!fn->is(VarKind::kMethod) || !args.empty() || fn->items.empty() || !fn->items[0]->is(VarKind::kTuple)) return nullptr;
  const VarPtr& self = fn->items[0];
  if (!self->real_type || !PyFunction_Check(fn->value)) return nullptr;
  // namedtuple renames the method (`NT._replace`); its code keeps where it was written.
  PyObject* qualname = PyObject_GetAttrString(((PyFunctionObject*)fn->value)->func_code, "co_qualname");
  const bool replace = qualname && PyUnicode_Check(qualname) &&
                       PyUnicode_CompareWithASCIIString(qualname, "namedtuple.<locals>._replace") == 0;
  if (!qualname) PyErr_Clear();
  Py_XDECREF(qualname);
  if (!replace) return nullptr;
  PyObject* fields = PyObject_GetAttrString((PyObject*)self->real_type, "_fields");
  if (!fields || !PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != (Py_ssize_t)self->items.size()) {
    PyErr_Clear();
    Py_XDECREF(fields);
    return nullptr;
  }
  std::vector<VarPtr> items = self->items;
  size_t matched = 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields); ++i)
    for (const auto& [name, value] : kwargs)
      if (PyUnicode_Compare(name, PyTuple_GET_ITEM(fields, i)) == 0) {
        items[i] = value;
        ++matched;
      }
  Py_DECREF(fields);
  if (matched != kwargs.size()) return nullptr;
  return make_typed_tuple(self->real_type, std::move(items));
}

VarPtr Tracer::call_python_construct(const VarPtr& fn, std::vector<VarPtr>& args, KwArgs& kwargs, bool* handled) {
  *handled = true;
  size_t n = args.size();
  if (is_super_factory(fn) && n == 0 && kwargs.empty()) return make_super(fn->items[0], fn->items[1]);
  if (is_super_factory(fn) && n == 2 && kwargs.empty() && args[0]->is(VarKind::kConst) && PyType_Check(args[0]->value))
    return make_super(args[0], args[1]);
  if (fn->is(VarKind::kFunction)) return inline_with_cells(fn->value, std::move(args), std::move(kwargs), &fn->items);
  if (VarPtr replaced = namedtuple_replace(fn, args, kwargs)) return replaced;
  if (fn->is(VarKind::kConst) && fn->source && Py_IS_TYPE(fn->value, (PyTypeObject*)partial_type())) {
    // A partial made outside (GELUTanh's `self.act = partial(F.gelu, approximate="tanh")`): its func, args and
    // keywords are read through it, each guarded as any attribute, and it is called as one made in the trace.
    static PyObject* func_name = PyUnicode_InternFromString("func");
    static PyObject* args_name = PyUnicode_InternFromString("args");
    static PyObject* keywords_name = PyUnicode_InternFromString("keywords");
    VarPtr func = get_attr(fn, func_name), bound = get_attr(fn, args_name), keywords = get_attr(fn, keywords_name);
    if (!bound->is(VarKind::kTuple) || !keywords->is(VarKind::kDict))
      KILN_UNSUPPORTED() << "calling " << fn->describe() << " (its arguments are not a tuple and a dict)";
    std::vector<VarPtr> parts = {func};
    parts.insert(parts.end(), bound->items.begin(), bound->items.end());
    VarPtr p = make_sequence(VarKind::kPartial, std::move(parts));
    for (size_t i = 0; i < keywords->keys.size(); ++i) {
      if (!PyUnicode_Check(keywords->keys[i])) KILN_UNSUPPORTED() << "a functools.partial with a keyword that is not a string";
      p->keys.push_back(Py_NewRef(keywords->keys[i]));
      p->items.push_back(keywords->items[i]);
    }
    return call(p, std::move(args), std::move(kwargs));
  }
  if (fn->is(VarKind::kPartial)) {
    // partial(f, *a, **k)(*b, **j) is f(*a, *b, **{**k, **j}).
    size_t nkw = fn->keys.size(), nbound = fn->items.size() - 1 - nkw;
    std::vector<VarPtr> all(fn->items.begin() + 1, fn->items.begin() + 1 + nbound);
    all.insert(all.end(), args.begin(), args.end());
    KwArgs merged;
    for (size_t i = 0; i < nkw; ++i) {
      bool overridden = false;
      for (const auto& kv : kwargs) overridden = overridden || PyUnicode_Compare(kv.first, fn->keys[i]) == 0;
      if (!overridden) merged.emplace_back(fn->keys[i], fn->items[1 + nbound + i]);
    }
    merged.insert(merged.end(), kwargs.begin(), kwargs.end());
    return call(fn->items[0], std::move(all), std::move(merged));
  }
  if (fn->is(VarKind::kMethod) && Py_TYPE(fn->value) == &PyMethodDescr_Type && fn->items[0]->is(VarKind::kConst)) {
    const VarPtr& self = fn->items[0];
    PyObject* descr = fn->value;
    std::string name = PyUnicode_AsUTF8(PyDescr_NAME(descr));
    if (context_var_type() && PyObject_TypeCheck(self->value, (PyTypeObject*)context_var_type()) && !self->by_type) {
      // ContextVar state is the process's: a set is kept as a pending token that its reset cancels, and
      // get() inside the pair sees the value set. A token cannot leave the trace (kToken), so an unmatched
      // set makes the frame run eagerly.
      if (name == "set" && n == 1 && kwargs.empty()) {
        VarPtr token = make_const(self->value);
        token->kind = VarKind::kToken;
        token->items.push_back(args[0]);
        context_var_sets_.push_back(token);
        return token;
      }
      if (name == "reset" && n == 1 && kwargs.empty()) {
        if (context_var_sets_.empty() || context_var_sets_.back() != args[0] || args[0]->value != self->value)
          KILN_UNSUPPORTED() << "ContextVar.reset of a token not made by the innermost ContextVar.set of this trace";
        context_var_sets_.pop_back();
        return make_const(Py_None);
      }
      if (name == "get") {
        for (auto it = context_var_sets_.rbegin(); it != context_var_sets_.rend(); ++it)
          if ((*it)->value == self->value) return (*it)->items[0];
        KILN_UNSUPPORTED() << "ContextVar.get outside a set/reset pair of the trace (its value is not guarded)";
      }
    }
    if (!self->by_type && all_constant(args, kwargs) && (PyUnicode_CheckExact(self->value) ||
        PyBytes_CheckExact(self->value) || PyLong_CheckExact(self->value) || PyFloat_CheckExact(self->value) ||
        PyTuple_CheckExact(self->value) || PyFrozenSet_CheckExact(self->value))) {
      // A method of an immutable value whose value is guarded (or a trace-time constant): folded.
      std::vector<VarPtr> all = {self};
      all.insert(all.end(), args.begin(), args.end());
      PyObject* r = call_on_values(descr, all, kwargs);
      if (!r) rethrow_python(name + "() of a " + Py_TYPE(self->value)->tp_name);
      VarPtr out = wrap_result(r);
      Py_DECREF(r);
      return out;
    }
    if (self->by_type && self->source && PyDict_Check(self->value) &&
        PyDescr_TYPE(descr) == &PyDict_Type && contains(helper("RECORD_READ_METHODS"), PyDescr_NAME(descr))) {
      // dict's own read methods on a dict subclass from the frame (super().get(...) of a registry): read
      // off its items, with its keys guarded.
      VarPtr snapshot = snapshot_dict(self);
      if (!kwargs.empty()) KILN_UNSUPPORTED() << "keyword arguments to dict." << name;
      return call_container_method(snapshot, name, std::move(args));
    }
  }
  if (fn->is(VarKind::kConst) && !fn->by_type) {
    PyObject* f = fn->value;
    if (f == (PyObject*)&PySuper_Type && n == 2 && kwargs.empty() && args[0]->is(VarKind::kConst) &&
        PyType_Check(args[0]->value))
      return make_super(args[0], args[1]);
    if (f == (PyObject*)&PyType_Type && n == 1 && kwargs.empty() && !is_constant(args[0])) {
      if (args[0]->is(VarKind::kModule) && args[0]->source) guards_->add_type(args[0]->source, Py_TYPE(args[0]->value));
      // With the value's source, the class keeps one too: what the trace reads off it (`type(self).count`) is
      // guarded like any other attribute, not folded unguarded.
      return make_const((PyObject*)type_of(args[0]), args[0]->source ? Source::type_of(args[0]->source) : nullptr);
    }
    static PyObject* ordered_dict = detail::lookup_once("collections", "OrderedDict");
    const bool default_dict = f == (PyObject*)detail::default_dict_type() && n <= 2 && (n == 0 || is_constant(args[0]));
    if (((f == (PyObject*)&PyDict_Type || f == ordered_dict) && n <= 1) || default_dict) {
      // dict(), dict(mapping_or_pairs, **kw): a new dict the trace owns. An OrderedDict is one too (the same order
      // and dict's methods; its own, move_to_end, are not traced), typed as such where it leaves the trace. So is a
      // defaultdict(factory, ...) of a constant factory (value = the factory; a missing key's read calls it).
      VarPtr out = make_dict({}, {});
      if (f == ordered_dict) out->real_type = (PyTypeObject*)ordered_dict;
      size_t first = 0;
      if (default_dict) {
        out->real_type = detail::default_dict_type();
        out->value = Py_NewRef(n ? args[0]->value : Py_None);
        if (out->value != Py_None && !PyCallable_Check(out->value)) {
          PyErr_SetString(PyExc_TypeError, "first argument must be callable or None");
          raise_pending("collections.defaultdict");
        }
        first = n ? 1 : 0;
      }
      if (n > first) {
        const VarPtr& from = args[first];
        if (from->is(VarKind::kDict)) {
          for (size_t i = 0; i < from->keys.size(); ++i) store_key(out, make_const(from->keys[i]), from->items[i]);
        } else {
          for (const VarPtr& pair : iterate(from)) {
            std::vector<VarPtr> kv = iterate(pair);
            if (kv.size() != 2) KILN_UNSUPPORTED() << "dict() of an item that is not a pair";
            store_key(out, kv[0], kv[1]);
          }
        }
      }
      for (const auto& [k, v] : kwargs) store_key(out, make_const(k), v);
      return out;
    }
    if (f == partial_type() && n >= 1) {
      VarPtr p = make_sequence(VarKind::kPartial, args);
      for (const auto& [k, v] : kwargs) {
        p->keys.push_back(Py_NewRef(k));
        p->items.push_back(v);
      }
      return p;
    }
    if (n == 0 && kwargs.empty())
      if (PyObject* answer = who_runs_answer(f)) return make_const(answer);
    if (guarded_query(f) && n == 0 && kwargs.empty()) {
      const SourcePtr asked = Source::call(Source::object(f, name_of(f)));
      PyObject* value = asked->resolve_from(f, SourceRoots{});
      if (!value) {
        // A build without the device raises (torch.cuda's dummy classes): the traced code may catch it, and the
        // guard asks again whether it raises the same.
        PyObject *type, *exception, *traceback;
        PyErr_Fetch(&type, &exception, &traceback);
        guards_->add_constant(Source::call_raises(asked->base()), type);
        PyErr_Restore(type, exception, traceback);
        raise_pending("asking " + name_of(f) + "()");
      }
      guards_->add_constant(asked, value);
      VarPtr out = make_const(value);
      Py_DECREF(value);
      return out;
    }
    if (f == builtin("next") && (n == 1 || n == 2) && kwargs.empty() &&
        (args[0]->is(VarKind::kGenerator) || args[0]->is(VarKind::kIterator))) {
      // next(gen) runs the generator's body to its next yield (`next(self.parameters())`); an exhausted one gives
      // the default, or raises StopIteration as in eager.
      const VarPtr& it = args[0];
      VarPtr item;
      if (it->is(VarKind::kGenerator)) item = generator_next(it);
      else if (it->position < it->items.size()) item = it->items[it->position++];
      if (item) return item;
      if (n == 2) return args[1];
      PyErr_SetNone(PyExc_StopIteration);
      raise_pending("next()");
    }
    if (f == builtin("iter") && n == 1 && kwargs.empty() && !(args[0]->is(VarKind::kConst) && PyIter_Check(args[0]->value))) {
      // A fresh iterator per call (a constant one folded into the trace would be shared by every call).
      if (args[0]->is(VarKind::kGenerator) || args[0]->is(VarKind::kIterator)) return args[0];  // its own iterator
      return make_sequence(VarKind::kIterator, iterate(args[0]));
    }
    if ((f == builtin("sorted") || f == builtin("min") || f == builtin("max")) && (n == 1 || f != builtin("sorted")) && n >= 1)
      if (VarPtr out = sort_by_key(f, args, kwargs)) return out;
    if ((f == builtin("sorted") || f == builtin("min") || f == builtin("max")) && n == 1 &&
        (args[0]->is(VarKind::kGenerator) || args[0]->is(VarKind::kIterator)) &&
        std::all_of(kwargs.begin(), kwargs.end(), [](const auto& kw) { return is_constant(kw.second); })) {
      // Over a generator or iterator of constants: its items taken (as eager consumes it), then folded.
      std::vector<VarPtr> items = iterate(args[0]);
      if (args[0]->is(VarKind::kIterator)) args[0]->position = args[0]->items.size();
      if (std::all_of(items.begin(), items.end(), [](const VarPtr& v) { return is_constant(v); })) {
        std::vector<VarPtr> list_arg = {make_sequence(VarKind::kList, std::move(items))};
        PyObject* r = call_on_values(f, list_arg, kwargs);
        if (!r) raise_pending("calling " + name_of(f));
        VarPtr out = wrap_result(r);
        Py_DECREF(r);
        return out;
      }
      KILN_UNSUPPORTED() << name_of(f) << " of a generator of traced values";
    }
    if (f == builtin("sum") && (n == 1 || n == 2) && kwargs.empty() && !is_constant(args[0])) {
      // sum(items, start) is start + items[0] + items[1] ..., left to right, as Python adds them.
      static PyObject* add = lookup("operator", "add");
      VarPtr total = n == 2 ? args[1] : make_const_steal(PyLong_FromLong(0));
      for (const VarPtr& item : iterate(args[0])) total = binary(add, total, item);
      return total;
    }
    if ((f == builtin("all") || f == builtin("any")) && n == 1 && kwargs.empty() && !is_constant(args[0])) {
      // all(items) / any(items): the items' truth values in order, up to the first that decides, so a generator
      // is advanced only as far as eager advances it. A tensor item is a data-dependent branch (Unsupported).
      const bool decides = f == builtin("any");
      PyObject* decided = decides ? Py_True : Py_False;
      if (args[0]->is(VarKind::kGenerator)) {
        constexpr size_t kMaxItems = 4096;  // as iterate(): a generator that never decides ends the trace
        size_t count = 0;
        while (VarPtr item = generator_next(args[0])) {
          if (truthy(item) == decides) return make_const(decided);
          if (++count == kMaxItems) KILN_UNSUPPORTED() << "all()/any() over more than " << kMaxItems << " items";
        }
      } else {
        for (const VarPtr& item : iterate(args[0]))
          if (truthy(item) == decides) return make_const(decided);
      }
      return make_const(decides ? Py_False : Py_True);
    }
    if (f == inspect_signature() && n == 1 && all_constant({}, kwargs)) return fold_signature(args[0], kwargs);
    if (PyType_Check(f) && all_constant(args, kwargs)) {
      if (VarPtr made = construct_stateless_module(f, args, kwargs)) return made;
    }
  }
  *handled = false;
  return nullptr;
}

VarPtr Tracer::sort_by_key(PyObject* f, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  // sorted(items, key=k, reverse=r), min/max(items, key=k[, default=d]) and min/max(a, b, ..., key=k): the keys are
  // computed in the trace (k inlined, once per item, in order), and must be constants; the order, or the item
  // chosen, is Python's own on them (stable, the first of equal extremes). nullptr when no key is given.
  VarPtr key, reverse, fallback;
  for (const auto& [name, value] : kwargs) {
    const std::string kw = PyUnicode_AsUTF8(name);
    if (kw == "key") key = value;
    else if (kw == "reverse" && f == builtin("sorted")) reverse = value;
    else if (kw == "default" && f != builtin("sorted") && args.size() == 1) fallback = value;
    else return nullptr;
  }
  if (!key || (key->is(VarKind::kConst) && key->value == Py_None)) return nullptr;
  if (reverse && !reverse->is(VarKind::kConst)) return nullptr;
  std::vector<VarPtr> items = args.size() == 1 ? iterate(args[0]) : args;
  if (args.size() == 1 && args[0]->is(VarKind::kIterator)) args[0]->position = args[0]->items.size();
  if (items.empty() && f != builtin("sorted")) {
    if (fallback) return fallback;
    PyErr_Format(PyExc_ValueError, "%s() iterable argument is empty", f == builtin("min") ? "min" : "max");
    raise_pending(name_of(f) + "()");
  }
  PyObject* keys = PyList_New(0);
  for (const VarPtr& item : items) {
    VarPtr k = call(key, {item}, {});
    if (!is_constant(k)) {
      Py_DECREF(keys);
      KILN_UNSUPPORTED() << name_of(f) << " with a key that gives a " << k->describe();
    }
    PyObject* v = to_python(k);
    if (!v || PyList_Append(keys, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(keys);
      rethrow_python("a sort key");
    }
    Py_DECREF(v);
  }
  // Python orders the positions by their keys: sorted(range(n), key=keys.__getitem__, reverse=...) or max/min(...).
  PyObject* count = PyLong_FromSize_t(items.size());
  PyObject* positions = PyObject_CallOneArg((PyObject*)&PyRange_Type, count);
  Py_DECREF(count);
  PyObject* getter = PyObject_GetAttrString(keys, "__getitem__");
  PyObject* kw = Py_BuildValue("{s:O}", "key", getter);
  if (reverse) PyDict_SetItemString(kw, "reverse", reverse->value);
  PyObject* call_args = PyTuple_Pack(1, positions);
  PyObject* order = PyObject_Call(f, call_args, kw);
  Py_DECREF(call_args);
  Py_DECREF(kw);
  Py_DECREF(getter);
  Py_DECREF(positions);
  Py_DECREF(keys);
  if (!order) raise_pending(name_of(f) + "()");  // keys that do not compare: TypeError, as in eager
  if (PyLong_Check(order)) {
    const size_t i = PyLong_AsSize_t(order);
    Py_DECREF(order);
    return items.at(i);
  }
  std::vector<VarPtr> sorted_items;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); ++i) sorted_items.push_back(items.at(PyLong_AsSize_t(PyList_GET_ITEM(order, i))));
  Py_DECREF(order);
  return make_sequence(VarKind::kList, std::move(sorted_items));
}

VarPtr Tracer::sort_list(const VarPtr& list, const KwArgs& kwargs) {
  // list.sort(key=None, reverse=False) in place: the order sorted() gives (sort_by_key with a key, else the items
  // themselves, constants, sorted by Python).
  if (!claim_container(list)) KILN_UNSUPPORTED() << "sorting a list from outside the trace";
  VarPtr sorted_items = sort_by_key(builtin("sorted"), {list}, kwargs);
  if (!sorted_items) {
    if (!is_constant(list) || !std::all_of(kwargs.begin(), kwargs.end(), [](const auto& kw) { return is_constant(kw.second); }))
      KILN_UNSUPPORTED() << "sorting a list of traced values";
    PyObject* r = call_on_values(builtin("sorted"), {list}, kwargs);
    if (!r) raise_pending("list.sort");
    sorted_items = wrap_result(r);
    Py_DECREF(r);
  }
  list->items = sorted_items->items;
  return make_const(Py_None);
}

int Tracer::first_live_generator_step() const {
  for (const auto& [weak, step] : generator_steps_)
    if (VarPtr g = weak.lock(); g && g->frame && !g->frame->finished()) return step;
  return -1;
}

VarPtr Tracer::wrap_referent(const VarPtr& ref) {
  const SourcePtr source = Source::call(ref->source);
  PyObject* referent = source->resolve_from(ref->value, SourceRoots{});
  if (!referent) rethrow_python("calling a weak reference");
  VarPtr out = wrap(referent, source);
  Py_DECREF(referent);
  return out;
}

VarPtr Tracer::call_cached_function(PyObject* f, std::vector<VarPtr> args, KwArgs kwargs) {
  auto pinned = [](const VarPtr& v) { return is_constant(v) && !holds_object_pinned_by_type(v); };
  if (std::all_of(args.begin(), args.end(), pinned) &&
      std::all_of(kwargs.begin(), kwargs.end(), [&](const auto& kw) { return pinned(kw.second); })) {
    PyObject* r = call_on_values(f, args, kwargs);
    if (!r) raise_pending("calling " + name_of(f));
    PyObject* plain = PyObject_CallOneArg(helper("is_plain_constant"), r);
    if (!plain) {
      Py_DECREF(r);
      rethrow_python("classifying a cached result");
    }
    Py_DECREF(plain);
    if (plain == Py_True) {
      VarPtr out = wrap_result(r);
      Py_DECREF(r);
      return out;
    }
    Py_DECREF(r);  // a tensor or an object: the function's body makes it in the trace instead
  }
  PyObject* wrapped = PyObject_GetAttrString(f, "__wrapped__");
  if (!wrapped) rethrow_python("reading a cached function's __wrapped__");
  VarPtr fn = make_const(wrapped);
  Py_DECREF(wrapped);
  return call(fn, std::move(args), std::move(kwargs));
}

VarPtr Tracer::new_tensor(const VarPtr& self, const VarPtr& data, KwArgs kwargs) {
  // x.new_tensor(data, ...) is torch.tensor(data, dtype=x.dtype, device=x.device, ...): the data becomes a graph
  // constant, as torch.tensor's does (on the fake it would make a tensor of the meta device's, with no data).
  static PyObject* tensor_fn = detail::lookup_once("torch", "tensor");
  static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
  static PyObject* device_name = PyUnicode_InternFromString("device");
  auto given = [&](PyObject* name) {
    return std::any_of(kwargs.begin(), kwargs.end(), [&](const auto& kw) { return PyUnicode_Compare(kw.first, name) == 0; });
  };
  if (!given(dtype_name)) kwargs.emplace_back(dtype_name, make_const_steal(detail::check(PyObject_GetAttr(self->value, dtype_name), "dtype")));
  if (!given(device_name)) kwargs.emplace_back(device_name, get_attr(self, device_name));
  return call(make_const(tensor_fn), {data}, std::move(kwargs));
}

VarPtr Tracer::construct_stateless_module(PyObject* cls, const std::vector<VarPtr>& args, const KwArgs& kwargs) {
  // Only torch.nn's classes qualify: anything else is refused before its arguments are materialised.
  PyObject* qualifies = PyObject_CallOneArg(helper("may_be_stateless_module"), cls);
  if (!qualifies) rethrow_python("inspecting a class");
  Py_DECREF(qualifies);
  if (qualifies != Py_True) return nullptr;
  std::vector<VarPtr> all = {make_const(cls)};
  all.insert(all.end(), args.begin(), args.end());
  PyObject* made = call_on_values(helper("make_stateless_module"), all, kwargs);
  if (!made) rethrow_python(std::string("constructing ") + ((PyTypeObject*)cls)->tp_name);
  if (made == Py_None) {
    Py_DECREF(made);
    return nullptr;
  }
  // Made by this trace from its constants: no source, nothing to guard (call_module's leaf path reads its
  // attributes as they are).
  VarPtr module = wrap(made, nullptr);
  Py_DECREF(made);
  return module;
}

VarPtr Tracer::fold_signature(const VarPtr& target, const KwArgs& kwargs) {
  // A function pinned by identity is taken to keep its code and defaults (as inlining it does), so its
  // signature is fixed; a method's signature does not depend on the instance it is bound to.
  PyObject* callable = nullptr;
  if (target->is(VarKind::kMethod) && PyFunction_Check(target->value))
    callable = PyMethod_New(target->value, Py_None);
  else if (target->is(VarKind::kConst) && !target->by_type && PyFunction_Check(target->value))
    callable = Py_NewRef(target->value);
  else
    KILN_UNSUPPORTED() << "inspect.signature of a " << target->describe();
  PyObject* py_args = PyTuple_Pack(1, callable);
  Py_DECREF(callable);
  PyObject* py_kwargs = PyDict_New();
  for (const auto& [k, v] : kwargs) PyDict_SetItem(py_kwargs, k, v->value);
  PyObject* r = PyObject_Call(inspect_signature(), py_args, py_kwargs);
  Py_DECREF(py_args);
  Py_DECREF(py_kwargs);
  if (!r) rethrow_python("inspect.signature");
  return make_const_steal(r);
}

bool Tracer::pin_context_var(const VarPtr& v) {
  if (!context_var_type() || !PyObject_TypeCheck(v->value, (PyTypeObject*)context_var_type())) return false;
  guards_->add_id(v->source, v->value);
  v->by_type = false;
  return true;
}

VarPtr Tracer::snapshot_dict(const VarPtr& obj) {
  PyObject* dict = obj->value;
  Py_ssize_t pos = 0;
  PyObject *k, *v;
  while (PyDict_Next(dict, &pos, &k, &v))
    if (!Source::is_plain_key(k)) KILN_UNSUPPORTED() << "reading a " << Py_TYPE(dict)->tp_name << " with keys other than str, int, None or objects compared by identity";
  PyObject* keys = PyTuple_New(PyDict_GET_SIZE(dict));
  std::vector<PyObject*> key_refs;
  std::vector<VarPtr> items;
  pos = 0;
  Py_ssize_t i = 0;
  while (PyDict_Next(dict, &pos, &k, &v)) {
    PyTuple_SET_ITEM(keys, i++, Py_NewRef(k));
    key_refs.push_back(Py_NewRef(k));
    items.push_back(wrap(v, Source::dict_item(obj->source, k)));
  }
  guards_->add_dict_keys(obj->source, keys);
  Py_DECREF(keys);
  return make_dict(std::move(key_refs), std::move(items), obj->source);
}

}  // namespace kiln::trace
