// Attribute, global and nonlocal assignments in traced code (STORE_ATTR, STORE_GLOBAL, STORE_DEREF of a
// free variable): `self.step = step + 1`, `self.cache = h`, `global calls; calls += 1`, and in a resume
// function the cells of the frame it continues. The trace records each one and its later reads see the new
// value; the compiled frame makes the same assignments for real right after its graph, in program order,
// before anything else runs (the caller, or at a graph break the break instruction and the resume
// function), so every Python reader sees what eager shows it. Assignments whose effect the trace cannot
// see through (a property setter, a custom __setattr__, an attribute of a built-in torch module that is
// called as a whole) stay graph breaks: CPython makes them between two graphs.
#include <unordered_set>

#include "common/error.h"
#include "trace/graph_break.h"
#include "trace/tracer.h"

namespace kiln::trace {

namespace {

// True for classes defined inside torch (nn.Linear, nn.Dropout...): the tracer calls such modules as a whole
// on the real object, so a store it only recorded would not reach them.
bool torch_class(PyTypeObject* type) {
  PyObject* module = PyObject_GetAttrString((PyObject*)type, "__module__");
  if (!module) {
    PyErr_Clear();
    return false;
  }
  const char* name = PyUnicode_Check(module) ? PyUnicode_AsUTF8(module) : nullptr;
  std::string text = name ? name : "";
  bool inside = text == "torch" || text.rfind("torch.", 0) == 0;
  Py_DECREF(module);
  return inside;
}

// The setattr that nn.Module subclasses inherit (their own __setattr__ overrides it).
bool plain_module_setattr(PyTypeObject* type) {
  static PyObject* module_setattr = [] {
    PyObject* nn = PyImport_ImportModule("torch.nn");
    PyObject* cls = nn ? PyObject_GetAttrString(nn, "Module") : nullptr;
    PyObject* fn = cls ? _PyType_Lookup((PyTypeObject*)cls, PyUnicode_InternFromString("__setattr__")) : nullptr;
    Py_XINCREF(fn);
    Py_XDECREF(cls);
    Py_XDECREF(nn);
    PyErr_Clear();
    return fn;
  }();
  return module_setattr && _PyType_Lookup(type, PyUnicode_InternFromString("__setattr__")) == module_setattr;
}

// A module slot dict (_parameters, _buffers) of `module` holding `name`.
bool in_module_slot(PyObject* module, const char* slot, PyObject* name) {
  PyObject** dictptr = _PyObject_GetDictPtr(module);
  PyObject* d = dictptr && *dictptr ? PyDict_GetItemString(*dictptr, slot) : nullptr;
  return d && PyDict_Check(d) && PyDict_Contains(d, name) == 1;
}

std::string why_unstorable_value(const VarPtr& value) {
  std::unordered_set<const Var*> seen;
  std::string why = unrebuildable(value, seen);
  return why.empty() ? "" : "the value is " + why;
}

}  // namespace

void Tracer::store_attribute(const VarPtr& obj, PyObject* name, const VarPtr& value) {
  if (obj->is(VarKind::kUserObject)) return store_user_object_attr(obj, name, value);  // its table, no replay
  std::string attr = PyUnicode_AsUTF8(name);
  auto refuse = [&](const std::string& why) {
    KILN_UNSUPPORTED() << "assigning ." << attr << " of a " << obj->describe() << " (" << why << ")";
  };
  if (!obj->source || !obj->value || !(obj->is(VarKind::kModule) || obj->is(VarKind::kConst)))
    refuse("only attributes of modules and objects the frame reads are assigned in the graph");
  PyObject* o = obj->value;
  PyTypeObject* type = Py_TYPE(o);
  if (PyType_Check(o) || PyModule_Check(o)) refuse("a class or a module");
  // A data descriptor (a property, a slot) runs code of its own on assignment.
  PyObject* descr = _PyType_Lookup(type, name);
  if (descr && Py_TYPE(descr)->tp_descr_set) refuse("a property or slot of its class");
  if (obj->is(VarKind::kModule)) {
    if (torch_class(type)) refuse("a built-in torch module, called as a whole on its real attributes");
    if (!plain_module_setattr(type)) refuse("its class overrides __setattr__");
    if (in_module_slot(o, "_parameters", name)) refuse("a parameter");
    bool tensor_or_none = value->is(VarKind::kTensor) || (value->is(VarKind::kConst) && value->value == Py_None);
    if (in_module_slot(o, "_buffers", name) && !tensor_or_none) refuse("a buffer assigned a non-tensor");
  } else {
    PyObject** dictptr = _PyObject_GetDictPtr(o);
    if (type->tp_setattro != PyObject_GenericSetAttr || !dictptr)
      refuse("its class has a custom __setattr__ or no instance dict");
  }
  std::string why = why_unstorable_value(value);
  if (!why.empty()) refuse(why);
  record_store({obj, o, name, value});
}

void Tracer::store_global(PyObject* globals, PyObject* name, const VarPtr& value) {
  std::string why = why_unstorable_value(value);
  if (!why.empty()) KILN_UNSUPPORTED() << "assigning the global " << PyUnicode_AsUTF8(name) << " (" << why << ")";
  record_store({nullptr, globals, name, value, /*item=*/true});
}

void Tracer::store_cell(int index, PyObject* cell, const VarPtr& value) {
  std::string why = why_unstorable_value(value);
  if (!why.empty()) KILN_UNSUPPORTED() << "assigning a variable of an enclosing function (" << why << ")";
  record_store({nullptr, cell, cell_contents_name(), value, /*item=*/false, index});
}

Tracer::Tracer::PendingStore* Tracer::find_store(PyObject* owner, PyObject* name) const {
  for (const PendingStore& store : stores_) {
    if (store.call || store.owner != owner) continue;
    // A dict's contents are one place (name None); attributes and items are places by name.
    if (name == Py_None ? store.contents : !store.contents && PyUnicode_Compare(store.name, name) == 0)
      return const_cast<PendingStore*>(&store);
  }
  return nullptr;
}

void Tracer::record_store(PendingStore store) {
  if (PendingStore* earlier = find_store(store.owner, store.name)) {
    earlier->value = store.value;  // one entry per place, at its first position
    return;
  }
  Py_INCREF(store.owner);
  Py_INCREF(store.name);
  stores_.push_back(std::move(store));
}

VarPtr Tracer::stored_value(PyObject* owner, PyObject* name) const {
  const PendingStore* store = find_store(owner, name);
  return store ? store->value : nullptr;
}

runtime::OutputSpec Tracer::with_stores(runtime::OutputSpec output, std::vector<PyObject*>& graph_outputs) {
  runtime::OutputSpec spec;
  spec.kind = runtime::OutputSpec::Kind::kStores;
  spec.children.push_back(std::move(output));
  spec.object = PyTuple_New(stores_.size());
  for (size_t i = 0; i < stores_.size(); ++i) {
    const PendingStore& store = stores_[i];
    runtime::OutputSpec target;
    if (store.target) {
      target.kind = runtime::OutputSpec::Kind::kSource;
      target.source = store.target->source;
    } else if (store.free_index >= 0) {
      target.kind = runtime::OutputSpec::Kind::kCell;  // this call's cell, passed by the frame
      target.index = store.free_index;
    } else {
      target.kind = runtime::OutputSpec::Kind::kConstant;
      target.object = Py_NewRef(store.owner);
    }
    spec.children.push_back(std::move(target));
    // A container's new contents are built from the items the trace left in it (its own spec would re-read it).
    const bool list = !store.call && store.contents && store.value->is(VarKind::kList);
    if (list) {
      runtime::OutputSpec items;
      items.kind = runtime::OutputSpec::Kind::kList;
      for (const VarPtr& item : store.value->items)
        items.children.push_back(output_spec(item, graph_outputs, /*break_output=*/true));
      spec.children.push_back(std::move(items));
    } else {
      spec.children.push_back(store.contents ? dict_spec(store.value, graph_outputs, /*break_output=*/true)
                                             : output_spec(store.value, graph_outputs, /*break_output=*/true));
    }
    const runtime::StoreKind kind = store.call       ? runtime::StoreKind::kCall
                                    : list           ? runtime::StoreKind::kListContents
                                    : store.contents ? runtime::StoreKind::kDictContents
                                    : store.item   ? runtime::StoreKind::kItem
                                                   : runtime::StoreKind::kAttribute;
    PyTuple_SET_ITEM(spec.object, i, Py_BuildValue("(Oi)", store.name, static_cast<int>(kind)));
  }
  return spec;
}

}  // namespace kiln::trace
