#pragma once
// The on-disk cache of compiled artefacts (DESIGN.md "Cache keys").
//
// Entries live in <root>/<kind>/<key><suffix>, next to <key><suffix>.sum, which holds the artefact's size and
// SHA-256. Keys are SHA-256 hex digests (common/sha256.h) of everything an entry depends on. Writers build into a
// unique temporary file and rename it into place (then the checksum), so a reader sees an old entry, a new entry or
// none, never half a file; two processes publishing the same key both succeed (the last rename wins, both files are
// equivalent). An entry whose checksum does not match is treated as missing and rebuilt.
//
// Trust: kiln dlopens libraries and loads CUDA images from here, so another user must not be able to put files in
// it. Missing directories are created 0700. Each operation checks the root (following a symbolic link) and the
// kind's directory (not one): directories owned by this process's user and writable by no one else; each entry read
// (libraries, images, graph and joint records, checksums) must be a regular file, not a symbolic link, owned by the
// user and writable by no one else, and is checked on the descriptor it is read from. The first failure turns the
// disk cache at that root off for the rest of the process, with one warning on stderr naming the path
// (log::warn_once); then lookups miss, publishing does nothing and builds go to a private directory (mkdtemp), so
// compilation goes on in memory. Without libcrypto there are no keys: the cache is off the same way.
// Ancestors of the root are not checked.
//
// Torch-free.
#include <cstdint>
#include <optional>
#include <string>

namespace kiln::cache {

/// KILN_CACHE_DIR, else $HOME/.cache/kiln, else $TMPDIR/kiln-<uid> (TMPDIR defaulting to /tmp). Read on every call
/// so tests can change it.
std::string cache_root();

/// The key of the entry for `material` (everything the entry depends on): its SHA-256 as 64 hex digits. nullopt
/// without libcrypto: the disk cache is off then (one warning).
std::optional<std::string> entry_key(const std::string& material);

/// Schema version of everything kiln writes into the cache: bump when keys, generated code or entry layout change.
constexpr int kSchemaVersion = 2;

struct CacheStats {
  int64_t kernels_compiled = 0;  // compiler invocations that produced a library
  int64_t cache_hits = 0;        // libraries loaded from disk without compiling
  int64_t memory_hits = 0;       // libraries already loaded in this process
  int64_t corrupt_entries = 0;   // entries whose checksum failed (then rebuilt)
  int64_t compile_failures = 0;  // compiler runs that failed (the graph then runs on the eager interpreter)
  int64_t graph_hits = 0;        // compiled graphs read back whole (graph_cache.h): no passes, codegen or compiler
  int64_t joint_hits = 0;        // autodiff's forward and backward graphs read back (cache/joint_cache.h)
};
CacheStats& stats();

/// The path of a valid, trusted entry, or nullopt (missing; corrupt: counted and ignored; untrusted: the cache is
/// turned off). Nobody else can replace the file afterwards: its directory is the user's alone.
std::optional<std::string> lookup(const std::string& kind, const std::string& key, const std::string& suffix);

/// The content of a valid, trusted entry, or nullopt (as lookup).
std::optional<std::string> read_entry(const std::string& kind, const std::string& key, const std::string& suffix);

/// Writes `content` as the entry for `key` (atomically, then its checksum); returns the entry's path, or nullopt
/// when the disk cache is off.
std::optional<std::string> publish_content(const std::string& kind, const std::string& key, const std::string& suffix,
                                           const std::string& content);

/// A fresh path for building the artefact (unique per process and call): in the entry's directory, or in a private
/// directory of this process (0700, removed at exit when empty) while the disk cache is off.
std::string temporary_path(const std::string& kind, const std::string& key, const std::string& suffix);

/// Moves the finished file at `built` into the cache as the entry for `key`; returns the entry's path. nullopt when
/// the disk cache is off: then `built` stays where it is, for the caller to use and remove.
std::optional<std::string> publish(const std::string& kind, const std::string& key, const std::string& suffix,
                                   const std::string& built);

/// Writes `text` to `path` atomically (a new file, mode 0600, renamed into place). Throws on I/O errors.
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace kiln::cache
