// The automatic-dynamic profile of a code object in the disk cache (DynamicPolicy::load_profile / store_profile,
// trace/symbolic_ints.h): which input dims changed size across the code's traces, kept as entries of kind "dynamic".
//
// As torch.compile's profile, it is kept only for a job: `torch.compiler.config.job_id` (TORCH_COMPILE_JOB_ID) names
// the workload whose processes may share it, and without one nothing is read or written (a profile from another
// workload would make dims symbolic that this one keeps static). An entry is text: a header line, then one line per
// input source, "<source>\t<dim>,<dim>,...", keyed by the job and the code's file, qualified name, first line and
// bytecode, so an edited function starts afresh. A profile only widens what becomes symbolic; every relation the
// symbolic graph relies on is still guarded, so a stale profile costs a recompile at worst, never a wrong result.
#include <Python.h>

#include <sstream>

#include "cache/kernel_cache.h"
#include "common/log.h"
#include "common/sha256.h"
#include "trace/symbolic_ints.h"

namespace kiln::trace {
namespace {

constexpr const char* kProfileKind = "dynamic";
constexpr const char* kProfileHeader = "kiln automatic-dynamic profile 1";

// str(getattr(object, name)), or "" (clearing the error).
std::string attribute_text(PyObject* object, const char* name) {
  PyObject* value = PyObject_GetAttrString(object, name);
  PyObject* text = value ? PyObject_Str(value) : nullptr;
  std::string out;
  if (text) {
    Py_ssize_t size = 0;
    if (const char* utf8 = PyUnicode_AsUTF8AndSize(text, &size)) out.assign(utf8, static_cast<size_t>(size));
  }
  Py_XDECREF(text);
  Py_XDECREF(value);
  PyErr_Clear();
  return out;
}

// torch.compiler.config.job_id, or "" (unset, or a torch without it).
std::string job_id() {
  PyObject* config = PyImport_ImportModule("torch.compiler.config");
  std::string out = config ? attribute_text(config, "job_id") : "";
  Py_XDECREF(config);
  PyErr_Clear();
  return out == "None" ? "" : out;
}

// The bytecode's bytes, or "".
std::string code_bytes(PyObject* code) {
  PyObject* bytes = PyObject_GetAttrString(code, "co_code");
  std::string out;
  if (bytes && PyBytes_Check(bytes)) out.assign(PyBytes_AS_STRING(bytes), static_cast<size_t>(PyBytes_GET_SIZE(bytes)));
  Py_XDECREF(bytes);
  PyErr_Clear();
  return out;
}

// `text`'s entries into `changed`; false (nothing read) when it is not a profile this build writes.
bool parse_profile(const std::string& text, std::map<std::string, std::set<int64_t>>& changed) {
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != kProfileHeader) return false;
  std::map<std::string, std::set<int64_t>> read;
  while (std::getline(in, line)) {
    const size_t tab = line.rfind('\t');
    if (tab == std::string::npos || tab == 0) return false;
    std::set<int64_t>& dims = read[line.substr(0, tab)];
    std::istringstream list(line.substr(tab + 1));
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 4) return false;
      dims.insert(std::stoll(item));
    }
  }
  for (auto& [path, dims] : read) changed[path].insert(dims.begin(), dims.end());
  return true;
}

}  // namespace

void DynamicPolicy::load_profile(PyObject* code) {
  const std::string file = attribute_text(code, "co_filename"), name = attribute_text(code, "co_qualname");
  const std::string line = attribute_text(code, "co_firstlineno");
  const std::string job = job_id();
  if (job.empty()) return;
  std::string identity = job;
  identity.append(1, '\0').append(file);
  identity.append(1, '\0').append(name).append(1, '\0').append(line).append(1, '\0').append(code_bytes(code));
  const std::optional<std::string> key = sha256_hex(identity);
  if (!key) return;  // no libcrypto: the disk cache is off too
  profile_key = *key;
  profile_where = name + " at " + file + ":" + line;
  const std::optional<std::string> text = cache::read_entry(kProfileKind, profile_key, ".txt");
  if (!text) return;
  if (!parse_profile(*text, changed))
    KILN_LOG(dynamic) << "the disk cache's profile of " << profile_where << " is not one this kiln reads; ignored";
}

void DynamicPolicy::store_profile() const {
  if (profile_key.empty()) return;
  std::ostringstream text;
  text << kProfileHeader << "\n";
  for (const auto& [path, dims] : changed) {
    if (dims.empty() || path.find('\n') != std::string::npos) continue;
    text << path << "\t";
    const char* sep = "";
    for (int64_t d : dims) {
      text << sep << d;
      sep = ",";
    }
    text << "\n";
  }
  try {
    cache::publish_content(kProfileKind, profile_key, ".txt", text.str());
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "could not store the automatic-dynamic profile of " << profile_where << ": " << e.what();
  }
}

}  // namespace kiln::trace
