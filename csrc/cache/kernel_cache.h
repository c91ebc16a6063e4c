#pragma once
// The on-disk cache of compiled artefacts (DESIGN.md "Cache keys").
//
// Entries live in <KILN_CACHE_DIR or ~/.cache/kiln>/<kind>/<key><suffix>, next to <key><suffix>.sum, which
// holds the artefact's size and content hash. Writers build into a unique temporary file and rename it into
// place (then the checksum), so a reader sees an old entry, a new entry or none, never half a file; two
// processes publishing the same key both succeed (the last rename wins, both files are equivalent). An entry
// whose checksum does not match is treated as missing and rebuilt.
//
// Torch-free.
#include <cstdint>
#include <optional>
#include <string>

namespace kiln::cache {

/// KILN_CACHE_DIR, else ~/.cache/kiln (read on every call so tests can change it).
std::string cache_root();

/// A 128-bit content hash as 32 hex digits (two FNV-1a lanes; not cryptographic, collisions are not a threat
/// model here: the key also names compiler, flags and versions).
std::string hash_hex(const std::string& data);

/// Schema version of everything kiln writes into the cache: bump when generated code or entry layout changes.
constexpr int kSchemaVersion = 1;

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

/// The path of a valid entry, or nullopt (missing, or corrupt: then it is counted and ignored).
std::optional<std::string> lookup(const std::string& kind, const std::string& key, const std::string& suffix);

/// The content of a valid entry, or nullopt (missing, or corrupt: then it is counted and ignored).
std::optional<std::string> read_entry(const std::string& kind, const std::string& key, const std::string& suffix);

/// Writes `content` as the entry for `key` (atomically, then its checksum); returns the entry's path.
std::string publish_content(const std::string& kind, const std::string& key, const std::string& suffix,
                            const std::string& content);

/// A fresh path in the entry's directory for building the artefact (unique per process and call).
std::string temporary_path(const std::string& kind, const std::string& key, const std::string& suffix);

/// Moves the finished file at `built` into the cache as the entry for `key`; returns the entry's path.
std::string publish(const std::string& kind, const std::string& key, const std::string& suffix, const std::string& built);

/// Writes `text` to `path` atomically (temporary file + rename). Throws on I/O errors.
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace kiln::cache
