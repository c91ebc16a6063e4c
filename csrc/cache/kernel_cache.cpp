// On-disk cache: where it lives, what it trusts, atomic publication and checksummed lookup (see kernel_cache.h).
#include "cache/kernel_cache.h"
#include "cache/cache_journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/log.h"
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

std::string temp_base() {
  const char* dir = std::getenv("TMPDIR");
  return dir && *dir ? dir : "/tmp";
}

// ---- trust ------------------------------------------------------------------------------------------------------

std::mutex g_refused_mutex;
std::set<std::string>& refused_roots() {
  static std::set<std::string> roots;
  return roots;
}

bool refused(const std::string& root) {
  std::lock_guard<std::mutex> lock(g_refused_mutex);
  return refused_roots().count(root) != 0;
}

// Turns the disk cache at `root` off for this process, with one warning naming `path` and what is wrong with it.
void refuse(const std::string& root, const std::string& path, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(g_refused_mutex);
    if (!refused_roots().insert(root).second) return;
  }
  log::warn_once("not using the disk cache at " + root + ": " + path + " " + why +
                 "; kiln compiles in memory instead (KILN_CACHE_DIR should name a directory of your own that no one "
                 "else can write to, mode 0700)");
}

std::string octal_mode(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// Why `st` may not be trusted, or "" when it is of the wanted type, owned by this process's user and writable by
// no one else.
std::string distrust(const struct stat& st, bool directory) {
  if (directory && !S_ISDIR(st.st_mode)) return "is not a directory";
  if (!directory && !S_ISREG(st.st_mode)) return "is not a regular file";
  if (st.st_uid != ::geteuid())
    return "belongs to uid " + std::to_string(st.st_uid) + ", not to this process's user (uid " +
           std::to_string(::geteuid()) + ")";
  if (st.st_mode & (S_IWGRP | S_IWOTH)) return "is writable by other users (mode " + octal_mode(st.st_mode) + ")";
  return "";
}

// Creates `path` and its missing parents, each 0700; an existing directory is left as it is (checked, not chmod'ed).
void make_dirs(const std::string& path) {
  std::string partial;
  std::stringstream parts(path);
  std::string piece;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(parts, piece, '/')) {
    if (piece.empty()) continue;
    partial += piece + "/";
    ::mkdir(partial.c_str(), 0700);  // EEXIST and the rest: the stat that follows tells
  }
}

// Why the directory `path` (created when missing) may not be trusted, or "". `follow`: a symbolic link to a trusted
// directory is fine (the root, which users may link elsewhere); else the link itself is refused.
std::string trust_directory(const std::string& path, bool follow) {
  struct stat st {};
  auto status = [&] { return follow ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st); };
  int rc = status();
  if (rc != 0 && errno == ENOENT) {
    make_dirs(path);
    rc = status();
  }
  if (rc != 0) return "cannot be created or read: " + std::string(std::strerror(errno));
  return distrust(st, /*directory=*/true);
}

void warn_without_crypto() {
  log::warn_once("the disk cache is off: " + sha256_unavailable() + "; kiln compiles in memory instead");
}

// Where `kind`'s entries live, once the root and that directory are trusted; nullopt while the disk cache is off.
struct Place {
  std::string root, dir;
};
std::optional<Place> place_of(const std::string& kind) {
  if (!sha256_unavailable().empty()) {
    warn_without_crypto();
    return std::nullopt;
  }
  Place place{cache_root(), cache_root() + "/" + kind};
  if (refused(place.root)) return std::nullopt;
  for (const std::string& dir : {place.root, place.dir})
    if (std::string why = trust_directory(dir, /*follow=*/dir == place.root); !why.empty()) {
      refuse(place.root, dir, why);
      return std::nullopt;
    }
  return place;
}

enum class Read { Ok, Missing, Refused };

// Reads the file at `path` into `out`, checked on the descriptor it is read from (no symbolic link is followed).
Read read_trusted(const Place& place, const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ELOOP) return Read::Missing;
    refuse(place.root, path, "is a symbolic link");
    return Read::Refused;
  }
  struct stat st {};
  std::string why = ::fstat(fd, &st) == 0 ? distrust(st, /*directory=*/false) : "cannot be read";
  if (why.empty()) {
    out.clear();
    char buf[1 << 16];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    if (n < 0) why = "cannot be read: " + std::string(std::strerror(errno));
  }
  ::close(fd);
  if (why.empty()) return Read::Ok;
  refuse(place.root, path, why);
  return Read::Refused;
}

// The private directory builds go to while the disk cache is off: mkdtemp makes it 0700 under a fresh name.
const std::string& scratch_dir() {
  static const std::string* dir = [] {
    auto path = std::make_unique<std::string>(temp_base() + "/kiln-build-XXXXXX");
    KILN_CHECK(::mkdtemp(path->data()) != nullptr)
        << "cannot create a private build directory in " << temp_base() << ": " << std::strerror(errno)
        << " (set TMPDIR to a writable directory)";
    std::atexit([] { ::rmdir(scratch_dir().c_str()); });  // empty by then: builds remove what they made
    return path.release();  // never destroyed, so the exit handler can still read it
  }();
  return *dir;
}

// ---- entries ----------------------------------------------------------------------------------------------------

std::string checksum(const std::string& content) {
  const std::optional<std::string> digest = sha256_hex(content);
  KILN_CHECK(digest.has_value()) << "libcrypto failed to hash a cache entry";
  return std::to_string(content.size()) + " " + *digest;
}

std::optional<std::string> read_valid(const Place& place, const std::string& path) {
  std::string content, recorded;
  if (read_trusted(place, path, content) != Read::Ok) return std::nullopt;
  const Read sum = read_trusted(place, path + ".sum", recorded);
  if (sum == Read::Refused) return std::nullopt;
  if (sum == Read::Missing || recorded != checksum(content)) {
    stats().corrupt_entries++;
    return std::nullopt;
  }
  return content;
}

bool read_file(const std::string& path, std::string& out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  out.clear();
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const bool ok = !std::ferror(f);
  std::fclose(f);
  return ok;
}

}  // namespace

std::string cache_root() {
  if (const char* dir = std::getenv("KILN_CACHE_DIR"); dir && *dir) return dir;
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/kiln";
  // Not the shared temporary directory itself: a folder of this user's, created 0700 and checked like any root.
  return temp_base() + "/kiln-" + std::to_string(::geteuid());
}

std::optional<std::string> entry_key(const std::string& material) {
  std::optional<std::string> key = sha256_hex(material);
  if (!key) warn_without_crypto();
  return key;
}

CacheStats& stats() {
  static CacheStats s;
  return s;
}

namespace {
struct Journal {
  std::mutex mutex;
  bool open = false;
  std::vector<JournalEntry> entries;
  std::set<std::string> seen;  // kind/key+suffix
};
Journal& journal() {
  static Journal j;
  return j;
}
}  // namespace

void open_journal() {
  Journal& j = journal();
  std::lock_guard<std::mutex> lock(j.mutex);
  j.open = true;
  j.entries.clear();
  j.seen.clear();
}

std::vector<JournalEntry> close_journal() {
  Journal& j = journal();
  std::lock_guard<std::mutex> lock(j.mutex);
  j.open = false;
  j.seen.clear();
  return std::move(j.entries);
}

bool journal_open() {
  Journal& j = journal();
  std::lock_guard<std::mutex> lock(j.mutex);
  return j.open;
}

void note_in_journal(const std::string& kind, const std::string& key, const std::string& suffix,
                     const std::string& content) {
  Journal& j = journal();
  std::lock_guard<std::mutex> lock(j.mutex);
  if (j.open && j.seen.insert(kind + "/" + key + suffix).second) j.entries.push_back({kind, key, suffix, content});
}

std::optional<std::string> read_entry(const std::string& kind, const std::string& key, const std::string& suffix) {
  const std::optional<Place> place = place_of(kind);
  if (!place) return std::nullopt;
  std::optional<std::string> content = read_valid(*place, place->dir + "/" + key + suffix);
  if (content) note_in_journal(kind, key, suffix, *content);
  return content;
}

std::optional<std::string> lookup(const std::string& kind, const std::string& key, const std::string& suffix) {
  const std::optional<Place> place = place_of(kind);
  if (!place) return std::nullopt;
  const std::string path = place->dir + "/" + key + suffix;
  const std::optional<std::string> content = read_valid(*place, path);
  if (!content) return std::nullopt;
  note_in_journal(kind, key, suffix, *content);
  return path;
}

std::string temporary_path(const std::string& kind, const std::string& key, const std::string& suffix) {
  const std::optional<Place> place = place_of(kind);
  return (place ? place->dir : scratch_dir()) + "/" + key + unique_suffix() + suffix;
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string temp = path + unique_suffix();
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  KILN_CHECK(fd >= 0) << "cannot write " << temp << ": " << std::strerror(errno);
  size_t written = 0;
  int write_errno = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n <= 0) {
      write_errno = n < 0 ? errno : EIO;
      break;
    }
    written += static_cast<size_t>(n);
  }
  ::close(fd);
  if (written != text.size()) {
    std::remove(temp.c_str());
    KILN_CHECK(false) << "cannot write " << temp << ": " << std::strerror(write_errno);
  }
  KILN_CHECK(std::rename(temp.c_str(), path.c_str()) == 0)
      << "cannot move " << temp << " to " << path << ": " << std::strerror(errno);
}

std::optional<std::string> publish_content(const std::string& kind, const std::string& key, const std::string& suffix,
                                           const std::string& content) {
  const std::optional<Place> place = place_of(kind);
  if (!place) return std::nullopt;
  const std::string path = place->dir + "/" + key + suffix;
  write_file_atomically(path, content);
  write_file_atomically(path + ".sum", checksum(content));
  note_in_journal(kind, key, suffix, content);
  return path;
}

std::optional<std::string> publish(const std::string& kind, const std::string& key, const std::string& suffix,
                                   const std::string& built) {
  const std::optional<Place> place = place_of(kind);
  if (!place) return std::nullopt;
  std::string content;
  KILN_CHECK(read_file(built, content)) << "the compiled artefact " << built << " is missing";
  // What the compiler wrote follows the umask: readers refuse files others may write.
  struct stat st {};
  if (::stat(built.c_str(), &st) == 0) ::chmod(built.c_str(), st.st_mode & 0755);
  const std::string path = place->dir + "/" + key + suffix;
  KILN_CHECK(std::rename(built.c_str(), path.c_str()) == 0)
      << "cannot move " << built << " into the cache at " << path << ": " << std::strerror(errno);
  write_file_atomically(path + ".sum", checksum(content));
  note_in_journal(kind, key, suffix, content);
  return path;
}

}  // namespace kiln::cache
