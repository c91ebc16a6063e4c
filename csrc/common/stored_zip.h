#pragma once
// A reader for zip files whose entries are stored uncompressed (method 0), as kiln.export's ExportedProgram.save
// writes them: the end-of-central-directory record, the central directory, each entry's local header, and every
// entry's CRC-32 checked when it is read. No compression, no encryption, no zip64, no multi-disk archives: such a
// file is rejected with a kiln::Error (ErrorKind::User) that names it. Torch-free and Python-free.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class StoredZip {
 public:
  struct Entry {
    std::string name;
    uint64_t offset = 0;  // of the entry's data in the archive
    uint64_t size = 0;
    uint32_t crc32 = 0;
  };

  /// Reads the file at `path` whole and indexes its entries; throws kiln::Error when it cannot be read or is not
  /// a zip of stored entries. `what` names the archive in messages ("model.kiln").
  static StoredZip open(const std::string& path);
  /// Indexes the entries of an archive held in memory.
  static StoredZip from_bytes(std::string bytes, const std::string& what);

  const std::vector<Entry>& entries() const { return entries_; }
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  /// The bytes of entry `name`, after its CRC-32 matched; throws kiln::Error when it is missing or corrupted.
  std::string_view read(std::string_view name) const;

 private:
  const Entry* find(std::string_view name) const;

  std::string bytes_;
  std::string what_;
  std::vector<Entry> entries_;
};

/// The CRC-32 of zip (and gzip, PNG): polynomial 0xEDB88320, reflected.
uint32_t crc32(std::string_view data);

}  // namespace kiln
