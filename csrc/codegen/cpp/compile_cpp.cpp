// Running the system C++ compiler and loading its output.
//
// Design: the cache key is the SHA-256 of the source, the compiler (resolved path, file size and mtime, so that
// an upgraded compiler misses without ever being run on a hit), the flags, the CPU model (-march=native), the
// caller's extra key (torch version) and the cache schema version. A process keeps what it loaded in a map keyed
// by all of that, so the same source is dlopen'ed once. While the disk cache is off (kernel_cache.h: untrusted,
// or no libcrypto) the library is built in a private directory, loaded and removed.
#include "codegen/cpp/compile_cpp.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "cache/cache_journal.h"
#include "cache/kernel_cache.h"
#include "common/error.h"
#include "common/log.h"
#include "common/progress.h"

namespace kiln::codegen::cpp {

namespace {

std::string resolve_in_path(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return program;
}

std::string compiler_identity(const std::string& compiler) {
  const std::string first = compiler.substr(0, compiler.find(' '));
  const std::string resolved = resolve_in_path(first);
  char real[4096];
  std::string id = ::realpath(resolved.c_str(), real) ? std::string(real) : resolved;
  struct stat st {};
  if (::stat(id.c_str(), &st) == 0) id += ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtime);
  return compiler + "|" + id;
}

std::string cpu_model() {
  static const std::string model = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("model name", 0) == 0) return line;
    return std::string("unknown cpu");
  }();
  return model;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::shared_ptr<SharedLibrary> load(const std::string& path) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  KILN_CHECK(handle) << "cannot load the compiled kernels " << path << ": " << ::dlerror();
  return std::make_shared<SharedLibrary>(handle, path);
}

}  // namespace

void* SharedLibrary::symbol(const std::string& name) const {
  void* fn = ::dlsym(handle_, name.c_str());
  KILN_ASSERT(fn) << "kernel " << name << " is missing from " << path_;
  return fn;
}

std::string cpp_compiler() {
  const char* cxx = std::getenv("CXX");
  return cxx && *cxx ? cxx : "c++";
}

std::string cpp_flags() { return "-O3 -march=native -fopenmp -shared -fPIC -std=c++17 -fno-math-errno -w"; }

std::shared_ptr<SharedLibrary> compile_cpp_library(const std::string& source, const std::string& extra_key) {
  static std::mutex mutex;
  // Keyed by everything the library depends on, not by its digest: a process never mistakes one library for another.
  static std::map<std::string, std::shared_ptr<SharedLibrary>> loaded;
  const std::string compiler = cpp_compiler();
  const std::string identity = source + "\n//" + compiler_identity(compiler) + "|" + cpp_flags() + "|" + cpu_model() +
                               "|" + extra_key + "|schema " + std::to_string(cache::kSchemaVersion);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded.find(identity); it != loaded.end()) {
    cache::stats().memory_hits++;
    // kiln.export's save bundles the library even when this process has it loaded already.
    if (cache::journal_open())
      if (const auto key = cache::entry_key(identity)) cache::lookup("cpp", *key, ".so");
    return it->second;
  }
  const std::optional<std::string> key = cache::entry_key(identity);  // nullopt without libcrypto: no disk cache
  if (auto path = key ? cache::lookup("cpp", *key, ".so") : std::nullopt) {
    progress::stage("load");
    auto library = load(*path);  // lookup checked the file and its directory: only this user can write them
    cache::stats().cache_hits++;
    loaded[identity] = library;
    return library;
  }
  const std::string name = key.value_or("kernels");
  const std::string source_path = cache::temporary_path("cpp", name, ".cpp");
  const std::string library_path = cache::temporary_path("cpp", name, ".so");
  const std::string log_path = cache::temporary_path("cpp", name, ".log");
  {
    std::ofstream out(source_path);
    out << source;
    KILN_CHECK(static_cast<bool>(out)) << "cannot write the generated source to " << source_path;
  }
  const std::string command = compiler + " " + cpp_flags() + " " + shell_quote(source_path) + " -o " +
                              shell_quote(library_path) + " > " + shell_quote(log_path) + " 2>&1";
  KILN_LOG(perf) << "compiling " << source_path;
  // One stage for the whole compiler run, often the longest: the line written here stays until it returns.
  progress::stage("compile C++ (" + compiler.substr(compiler.find_last_of('/') + 1) + ")");
  const int status = std::system(command.c_str());
  const std::string compiler_output = read_text(log_path);
  std::remove(log_path.c_str());
  if (status != 0) {
    cache::stats().compile_failures++;
    std::remove(library_path.c_str());
    std::remove(source_path.c_str());
    KILN_CHECK(false) << "the C++ compiler failed (" << command << ", status " << status << "): "
                      << compiler_output.substr(0, 4000);
  }
  cache::stats().kernels_compiled++;
  progress::stage("load");
  const std::optional<std::string> entry = key ? cache::publish("cpp", *key, ".so", library_path) : std::nullopt;
  if (entry)
    cache::publish("cpp", *key, ".cpp", source_path);  // kept next to the library for debugging
  else
    std::remove(source_path.c_str());
  auto library = load(entry.value_or(library_path));
  if (!entry) std::remove(library_path.c_str());  // built in a private directory; the loaded mapping stays
  loaded[identity] = library;
  return library;
}

}  // namespace kiln::codegen::cpp
