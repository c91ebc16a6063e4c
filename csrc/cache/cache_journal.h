#pragma once
// A journal of the disk-cache entries the compiles of a stretch of code use (read, found or written), with their
// contents: kiln.export's save opens it around one compile of the exported graph and bundles those entries (the
// compiled graph record, the C++ library or CUDA images) into the file; kiln.load publishes them back into the cache
// (publish_content) before compiling, so that compile finds everything and runs no compiler. Process-wide, because
// CUDA programs are published from worker threads. Defined in kernel_cache.cpp, which records into it. Torch-free.
#include <string>
#include <vector>

namespace kiln::cache {

struct JournalEntry {
  std::string kind;     ///< the cache's folder: "graphs", "cpp", "cuda"
  std::string key;      ///< the entry's key (64 hex digits)
  std::string suffix;   ///< ".so", ".cubin", ...
  std::string content;  ///< the entry's bytes
};

/// Starts recording (dropping anything recorded before).
void open_journal();
/// Stops recording and returns the entries used since open_journal, each once, in first-use order.
std::vector<JournalEntry> close_journal();
/// Whether a journal is open (callers that skip the cache on an in-memory hit then note the entry themselves).
bool journal_open();
/// Records one entry while a journal is open; does nothing otherwise.
void note_in_journal(const std::string& kind, const std::string& key, const std::string& suffix,
                     const std::string& content);

}  // namespace kiln::cache
