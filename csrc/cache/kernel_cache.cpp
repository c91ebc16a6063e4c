// On-disk cache: atomic publication and checksummed lookup (see kernel_cache.h).
#include "cache/kernel_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "common/error.h"
#include "common/sha256.h"

namespace kiln::cache {

namespace {

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// A name no other call of this process (nor, with its pid, of another) picks in the same directory.
std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return ".tmp." + std::to_string(::getpid()) + "." + hex64(salt ^ counter++);
}

void make_dirs(const std::string& path) {
  std::string partial;
  std::stringstream parts(path);
  std::string piece;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(parts, piece, '/')) {
    if (piece.empty()) continue;
    partial += piece + "/";
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
      KILN_CHECK(false) << "cannot create the cache directory " << partial << ": " << std::strerror(errno)
                        << " (set KILN_CACHE_DIR to a writable directory)";
  }
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  out = buffer.str();
  return true;
}

std::string checksum(const std::string& content) {
  const std::optional<std::string> digest = sha256_hex(content);
  KILN_CHECK(digest.has_value()) << "libcrypto failed to hash a cache entry";
  return std::to_string(content.size()) + " " + *digest;
}

std::string entry_dir(const std::string& kind) { return cache_root() + "/" + kind; }

}  // namespace

std::string cache_root() {
  if (const char* dir = std::getenv("KILN_CACHE_DIR"); dir && *dir) return dir;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/kiln";
}

std::optional<std::string> entry_key(const std::string& material) { return sha256_hex(material); }

CacheStats& stats() {
  static CacheStats s;
  return s;
}

std::optional<std::string> read_entry(const std::string& kind, const std::string& key, const std::string& suffix) {
  const std::string path = entry_dir(kind) + "/" + key + suffix;
  std::string content, recorded;
  if (!read_file(path, content)) return std::nullopt;
  if (!read_file(path + ".sum", recorded) || recorded != checksum(content)) {
    stats().corrupt_entries++;
    return std::nullopt;
  }
  return content;
}

std::optional<std::string> lookup(const std::string& kind, const std::string& key, const std::string& suffix) {
  if (!read_entry(kind, key, suffix)) return std::nullopt;
  return entry_dir(kind) + "/" + key + suffix;
}

std::string temporary_path(const std::string& kind, const std::string& key, const std::string& suffix) {
  make_dirs(entry_dir(kind));
  return entry_dir(kind) + "/" + key + unique_suffix() + suffix;
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string temp = path + unique_suffix();
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    KILN_CHECK(static_cast<bool>(out)) << "cannot write " << temp << ": " << std::strerror(errno);
    out << text;
    out.flush();
    KILN_CHECK(static_cast<bool>(out)) << "cannot write " << temp << ": " << std::strerror(errno);
  }
  KILN_CHECK(std::rename(temp.c_str(), path.c_str()) == 0)
      << "cannot move " << temp << " to " << path << ": " << std::strerror(errno);
}

std::string publish_content(const std::string& kind, const std::string& key, const std::string& suffix,
                            const std::string& content) {
  make_dirs(entry_dir(kind));
  const std::string path = entry_dir(kind) + "/" + key + suffix;
  write_file_atomically(path, content);
  write_file_atomically(path + ".sum", checksum(content));
  return path;
}

std::string publish(const std::string& kind, const std::string& key, const std::string& suffix, const std::string& built) {
  std::string content;
  KILN_CHECK(read_file(built, content)) << "the compiled artefact " << built << " is missing";
  const std::string path = entry_dir(kind) + "/" + key + suffix;
  KILN_CHECK(std::rename(built.c_str(), path.c_str()) == 0)
      << "cannot move " << built << " into the cache at " << path << ": " << std::strerror(errno);
  write_file_atomically(path + ".sum", checksum(content));
  return path;
}

}  // namespace kiln::cache
