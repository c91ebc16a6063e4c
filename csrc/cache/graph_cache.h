#pragma once
// Whole compiled graphs on disk (DESIGN.md "Cache keys"): the CompiledArtifact the pipeline made of a captured graph
// (the optimised graph, the run plan's kernels and steps, the generated source and how to launch each kernel),
// found again in a new process from the captured graph alone, so that a warm start runs no graph passes, no
// scheduling and no code generation. The compiled library or CUDA images themselves stay in their own caches
// (codegen/cpp, codegen/cuda), keyed by the source this record holds.
//
// Keys hash the captured graph's exact bytes (graph_bytes.h) with everything else compilation depends on: kiln's
// build (its library's size and modification time), the torch version, the device and the backend's flags. An
// entry that fails its checksum or does not parse is ignored (counted in cache::stats) and rebuilt.
//
// Torch-free.
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cache/compiled_artifact.h"
#include "graph/graph.h"

namespace kiln::cache {

/// The key of `captured` compiled under `context` (device, flags: whatever else the result depends on): a SHA-256 hex
/// digest; nullopt when nothing can be keyed (no libcrypto: the disk cache is off).
std::optional<std::string> graph_key(const graph::Graph& captured, const std::string& context);

/// The artefact stored under `key` with the tensors of `captured`'s constants attached (attach_constants), or nullopt
/// when there is none, its constants do not match, or it is unreadable (then it is counted as a corrupt entry and
/// logged under `fallbacks`).
std::optional<CompiledArtifact> load_artifact(const std::string& key, const graph::Graph& captured);

/// The artefact a graph record's bytes hold (a record kiln.export bundled into a file: kernels/graphs/), with the
/// constants of `captured` attached as load_artifact attaches them; nullopt when its constants do not match. Throws
/// kiln::Error when the bytes do not decode.
std::optional<CompiledArtifact> artifact_from_bytes(const std::string& bytes, const graph::Graph& captured);

/// Stores `artifact` under `key`, unless one of its constants has no source in the captured graph. I/O errors are
/// logged, never thrown: the cache is an optimisation.
void store_artifact(const std::string& key, const CompiledArtifact& artifact);

/// Per value of `derived` (a graph built from `captured`: passes may renumber values): for a constant, the id of the
/// constant of `captured` holding the same tensor (kUnknownConstant when none does: such a graph is not stored); else -1.
constexpr graph::ValueId kUnknownConstant = -2;
std::vector<graph::ValueId> constant_sources(const graph::Graph& captured, const graph::Graph& derived);

/// Gives the constants of `derived`, read back without tensors, the tensors of the constants of `captured` that
/// `sources` names; false (nothing to use) when they do not match.
bool attach_constants(graph::Graph& derived, const std::vector<graph::ValueId>& sources, const graph::Graph& captured);

/// Other records kept under the same rules as graph records (checksums, atomic writes, kiln's build in the key):
/// `kind` names their folder ("joints": autodiff's forward and backward graphs). nullopt when missing or corrupt.
std::optional<std::string> load_record_bytes(const std::string& kind, const std::string& key);
void store_record_bytes(const std::string& kind, const std::string& key, const std::string& bytes);
/// For a record whose bytes passed their checksum but do not decode: counted as corrupt, logged, then rebuilt.
void ignore_unreadable(const std::string& kind, const std::string& key, const std::exception& e);

/// "<size>-<mtime ns>" of the shared library this code is linked into (kiln's build), "" when unknown.
const std::string& build_identity();

}  // namespace kiln::cache
