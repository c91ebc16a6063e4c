// cache/kernel_cache: keys are SHA-256 digests, cache directories are the user's alone, and a cache another user
// could write to is neither read nor written.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "cache/kernel_cache.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

// A fresh KILN_CACHE_DIR per test: a root refused once stays refused for the process.
struct TemporaryRoot {
  fs::path path;
  explicit TemporaryRoot(const std::string& name)
      : path(fs::temp_directory_path() / ("kiln_kernel_cache_test_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    ::setenv("KILN_CACHE_DIR", path.c_str(), 1);
  }
  ~TemporaryRoot() {
    ::unsetenv("KILN_CACHE_DIR");
    fs::remove_all(path);
  }
};

mode_t mode_of(const fs::path& p) {
  struct stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

}  // namespace

TEST_CASE("entry keys are SHA-256 digests of everything an entry depends on") {
  CHECK(cache::entry_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(cache::entry_key("source a") != cache::entry_key("source b"));
}

TEST_CASE("new cache directories are 0700 and entries come back") {
  TemporaryRoot root("fresh");
  const std::string key = cache::entry_key("an entry").value();
  const std::optional<std::string> path = cache::publish_content("graphs", key, ".kgraph", "content");
  REQUIRE(path);
  CHECK(mode_of(root.path) == 0700);
  CHECK(mode_of(root.path / "graphs") == 0700);
  CHECK((mode_of(*path) & 022) == 0);
  CHECK(cache::read_entry("graphs", key, ".kgraph") == "content");
  CHECK(cache::lookup("graphs", key, ".kgraph") == path);
}

TEST_CASE("a root other users can write to is neither read nor written") {
  TemporaryRoot root("world_writable");
  fs::create_directories(root.path / "graphs");
  ::chmod(root.path.c_str(), 0777);
  write(root.path / "graphs" / "k.kgraph", "planted");
  CHECK_FALSE(cache::read_entry("graphs", "k", ".kgraph"));
  CHECK_FALSE(cache::publish_content("graphs", "other", ".kgraph", "content"));
  CHECK_FALSE(fs::exists(root.path / "graphs" / "other.kgraph"));
  // Builds go to a private directory instead.
  const fs::path built = cache::temporary_path("cpp", "k", ".so");
  CHECK(built.parent_path() != root.path / "cpp");
  CHECK(mode_of(built.parent_path()) == 0700);
  CHECK_FALSE(fs::exists(root.path / "cpp"));
}

TEST_CASE("a kind's directory other users can write to turns the cache off") {
  TemporaryRoot root("kind_dir");
  REQUIRE(cache::publish_content("cuda", "k", ".cubin", "image"));
  ::chmod((root.path / "cuda").c_str(), 0777);
  CHECK_FALSE(cache::read_entry("cuda", "k", ".cubin"));
  CHECK_FALSE(cache::read_entry("graphs", "k", ".kgraph"));  // the whole root is off now
}

TEST_CASE("an entry other users can write to is refused even with a matching checksum") {
  TemporaryRoot root("group_writable_file");
  const std::optional<std::string> path = cache::publish_content("cpp", "k", ".so", "library");
  REQUIRE(path);
  ::chmod(path->c_str(), 0664);
  CHECK_FALSE(cache::lookup("cpp", "k", ".so"));
  CHECK_FALSE(cache::publish_content("cpp", "k2", ".so", "library"));
}

TEST_CASE("an entry that is a symbolic link is refused") {
  TemporaryRoot root("symlink");
  const std::optional<std::string> path = cache::publish_content("cpp", "k", ".so", "library");
  REQUIRE(path);
  fs::rename(*path, root.path / "elsewhere.so");
  fs::create_symlink(root.path / "elsewhere.so", *path);
  CHECK_FALSE(cache::lookup("cpp", "k", ".so"));
}

TEST_CASE("an entry owned by another user is refused") {
  if (::geteuid() != 0) return;  // only root can give a file away
  TemporaryRoot root("foreign_file");
  const std::optional<std::string> path = cache::publish_content("cpp", "k", ".so", "library");
  REQUIRE(path);
  REQUIRE(::chown(path->c_str(), 65534, 65534) == 0);
  CHECK_FALSE(cache::lookup("cpp", "k", ".so"));
}

TEST_CASE("without HOME the root is a folder of the user's in TMPDIR, not TMPDIR itself") {
  const char* home = std::getenv("HOME");
  const std::string saved = home ? home : "";
  ::unsetenv("KILN_CACHE_DIR");
  ::unsetenv("HOME");
  const std::string root = cache::cache_root();
  if (home) ::setenv("HOME", saved.c_str(), 1);
  const char* tmpdir = std::getenv("TMPDIR");
  CHECK(root == std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/kiln-" + std::to_string(::geteuid()));
}
