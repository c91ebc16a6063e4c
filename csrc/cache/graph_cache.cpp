// Whole compiled graphs on disk (see graph_cache.h).
#include "cache/graph_cache.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <unordered_map>

#include "cache/kernel_cache.h"
#include "common/error.h"
#include "common/log.h"
#include "graph/graph_bytes.h"

namespace kiln::cache {

namespace {

constexpr const char* kKind = "graphs";
constexpr const char* kSuffix = ".kgraph";
constexpr int64_t kRecordFormat = 5;  // 4: size arguments; 5: tuning variants
constexpr int64_t kLimit = 1 << 30;

void write_entry(graph::ByteWriter& w, const KernelEntry& entry) {
  w.text(entry.name);
  w.integer(entry.grid);
  w.integer(entry.block_x);
  w.integer(entry.block_y);
  w.text(entry.strategy);
  w.integer(entry.part);
  w.integers(entry.sizes);
  w.integer(static_cast<int64_t>(entry.variants.size()));
  for (const KernelEntry& variant : entry.variants) write_entry(w, variant);
  w.text(entry.tune_key);
}

// `variant`: an entry of KernelEntry::variants, which has none of its own.
KernelEntry read_entry(graph::ByteReader& r, int64_t num_parts, bool variant = false) {
  KernelEntry entry;
  entry.name = r.text();
  entry.grid = static_cast<unsigned>(r.count(0xffffffffLL));
  entry.block_x = static_cast<unsigned>(r.count(1024));
  entry.block_y = static_cast<unsigned>(r.count(1024));
  entry.strategy = r.text();
  entry.part = static_cast<int>(r.count(std::max<int64_t>(num_parts - 1, 0)));
  entry.sizes = r.integers();
  entry.variants.resize(r.count(variant ? 0 : kLimit));
  for (KernelEntry& v : entry.variants) v = read_entry(r, num_parts, /*variant=*/true);
  entry.tune_key = r.text();
  return entry;
}

void write_texts(graph::ByteWriter& w, const std::vector<std::string>& texts) {
  w.integer(static_cast<int64_t>(texts.size()));
  for (const std::string& t : texts) w.text(t);
}

std::vector<std::string> read_texts(graph::ByteReader& r) {
  std::vector<std::string> texts(r.count(kLimit));
  for (std::string& t : texts) t = r.text();
  return texts;
}

std::string encode(const CompiledArtifact& record) {
  graph::ByteWriter w;
  w.integer(kRecordFormat);
  graph::write_graph(w, record.optimised);
  w.integer(static_cast<int64_t>(record.steps.size()));
  for (const fusion::Step& step : record.steps) {
    w.integer(step.kind == fusion::Step::Kind::Kernel);
    w.integer(step.index);
  }
  w.integer(static_cast<int64_t>(record.kernels.size()));
  for (const PlannedKernel& k : record.kernels) {
    w.text(k.name);
    w.integer(static_cast<int64_t>(k.buffers.size()));
    for (const fusion::KernelBuffer& b : k.buffers) {
      w.integer(b.value);
      w.integer(static_cast<int64_t>(b.dtype));
      w.integer(b.is_output);
    }
    w.integers(std::vector<int64_t>(k.in_place_from.begin(), k.in_place_from.end()));
    w.integer(k.gathers);
  }
  w.text(record.code.backend);
  w.integer(record.code.size_arguments);
  write_texts(w, record.code.parts);
  w.integer(static_cast<int64_t>(record.code.kernels.size()));
  for (const KernelEntry& entry : record.code.kernels) write_entry(w, entry);
  write_entry(w, record.code.group);
  w.integers(std::vector<int64_t>(record.code.group_members.begin(), record.code.group_members.end()));
  w.integers(std::vector<int64_t>(record.constant_sources.begin(), record.constant_sources.end()));
  return w.take();
}

CompiledArtifact decode(const std::string& bytes) {
  graph::ByteReader r(bytes);
  KILN_CHECK_EQ(r.integer(), kRecordFormat) << "record format";
  CompiledArtifact record;
  record.optimised = graph::read_graph(r);
  const auto num_values = static_cast<int64_t>(record.optimised.values.size());
  record.steps.resize(r.count(kLimit));
  for (fusion::Step& step : record.steps) {
    step.kind = r.integer() ? fusion::Step::Kind::Kernel : fusion::Step::Kind::Extern;
    step.index = static_cast<int32_t>(r.count(kLimit));
  }
  record.kernels.resize(r.count(kLimit));
  for (PlannedKernel& k : record.kernels) {
    k.name = r.text();
    k.buffers.resize(r.count(kLimit));
    for (fusion::KernelBuffer& b : k.buffers) {
      b.value = static_cast<graph::ValueId>(r.count(num_values - 1));
      b.dtype = static_cast<graph::ScalarType>(r.integer());
      b.is_output = r.integer() != 0;
    }
    for (int64_t from : r.integers()) {
      KILN_CHECK(from >= -1 && from < static_cast<int64_t>(k.buffers.size())) << "in-place source " << from;
      k.in_place_from.push_back(static_cast<int32_t>(from));
    }
    k.gathers = r.integer() != 0;
  }
  record.code.backend = r.text();
  record.code.size_arguments = r.integer() != 0;
  record.code.parts = read_texts(r);
  const auto num_parts = static_cast<int64_t>(record.code.parts.size());
  record.code.kernels.resize(r.count(kLimit));
  for (KernelEntry& entry : record.code.kernels) entry = read_entry(r, num_parts);
  record.code.group = read_entry(r, num_parts);
  const auto num_kernels = static_cast<int64_t>(record.kernels.size());
  for (int64_t member : r.integers()) {
    KILN_CHECK(member >= 0 && member < num_kernels) << "launch group member " << member;
    record.code.group_members.push_back(static_cast<int32_t>(member));
  }
  for (int64_t source : r.integers()) record.constant_sources.push_back(static_cast<graph::ValueId>(source));
  KILN_CHECK(r.at_end()) << "trailing bytes";
  // What the run plan indexes must exist.
  const auto num_nodes = static_cast<int64_t>(record.optimised.nodes.size());
  for (const fusion::Step& step : record.steps)
    KILN_CHECK(step.index < (step.kind == fusion::Step::Kind::Kernel ? num_kernels : num_nodes)) << "step " << step.index;
  KILN_CHECK(record.code.kernels.empty() || record.code.kernels.size() == record.kernels.size()) << "kernel entry count";
  return record;
}

}  // namespace

std::optional<std::string> graph_key(const graph::Graph& captured, const std::string& context) {
  graph::ByteWriter w;
  w.text("kiln graph record " + std::to_string(kSchemaVersion) + "." + std::to_string(kRecordFormat));
  w.text(build_identity());
  w.text(context);
  graph::write_graph(w, captured);
  return entry_key(w.bytes());
}

std::optional<CompiledArtifact> load_artifact(const std::string& key, const graph::Graph& captured) {
  std::optional<std::string> bytes = load_record_bytes(kKind, key);
  if (!bytes) return std::nullopt;
  try {
    return artifact_from_bytes(*bytes, captured);
  } catch (const std::exception& e) {
    ignore_unreadable(kKind, key, e);
    return std::nullopt;
  }
}

std::optional<CompiledArtifact> artifact_from_bytes(const std::string& bytes, const graph::Graph& captured) {
  CompiledArtifact record = decode(bytes);
  if (!attach_constants(record.optimised, record.constant_sources, captured)) return std::nullopt;
  return record;
}

void store_artifact(const std::string& key, const CompiledArtifact& record) {
  const auto& sources = record.constant_sources;
  if (std::find(sources.begin(), sources.end(), kUnknownConstant) != sources.end()) return;
  store_record_bytes(kKind, key, encode(record));
}

std::vector<graph::ValueId> constant_sources(const graph::Graph& captured, const graph::Graph& derived) {
  std::unordered_map<PyObject*, graph::ValueId> by_tensor;
  for (const graph::Value& v : captured.values)
    if (v.is_constant) by_tensor.emplace(v.constant.get(), v.id);
  std::vector<graph::ValueId> sources(derived.values.size(), -1);
  for (const graph::Value& v : derived.values) {
    if (!v.is_constant) continue;
    auto it = by_tensor.find(v.constant.get());
    sources[v.id] = it == by_tensor.end() ? kUnknownConstant : it->second;
  }
  return sources;
}

bool attach_constants(graph::Graph& derived, const std::vector<graph::ValueId>& sources, const graph::Graph& captured) {
  if (sources.size() != derived.values.size()) return false;
  for (graph::Value& v : derived.values) {
    if (!v.is_constant) continue;
    const graph::ValueId source = sources[v.id];
    if (source < 0 || source >= static_cast<graph::ValueId>(captured.values.size())) return false;
    const graph::Value& c = captured.values[source];
    if (!c.is_constant || c.meta.sizes != v.meta.sizes || c.meta.strides != v.meta.strides || c.meta.dtype != v.meta.dtype)
      return false;
    v.constant = c.constant;
  }
  return true;
}

std::optional<std::string> load_record_bytes(const std::string& kind, const std::string& key) {
  if (build_identity().empty()) return std::nullopt;
  return read_entry(kind, key, kSuffix);
}

void ignore_unreadable(const std::string& kind, const std::string& key, const std::exception& e) {
  stats().corrupt_entries++;
  KILN_LOG(fallbacks) << "kiln graph cache: ignoring the unreadable " << kind << " entry " << key << " (" << e.what() << ")";
}

void store_record_bytes(const std::string& kind, const std::string& key, const std::string& bytes) {
  if (build_identity().empty()) return;
  try {
    publish_content(kind, key, kSuffix, bytes);
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln graph cache: not stored: " << e.what();
  }
}

const std::string& build_identity() {
  static const std::string identity = [] {
    Dl_info info{};
    if (!dladdr(reinterpret_cast<const void*>(&build_identity), &info) || !info.dli_fname) return std::string();
    struct stat st {};
    if (::stat(info.dli_fname, &st) != 0) return std::string();
    return std::to_string(st.st_size) + "-" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
  }();
  return identity;
}

}  // namespace kiln::cache
