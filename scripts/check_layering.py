#!/usr/bin/env python3
"""Fails on an #include that climbs: DESIGN.md's layers depend downward only.

Every file under csrc/ is read for `#include "folder/..."` lines. A file in csrc/<folder>/ (or a subfolder
of it) may include headers of its own folder and of folders in the same or a lower layer of LAYERS, never
of a higher one, and never across an edge of FORBIDDEN. System headers (<...>) and CPython's own
`internal/...` headers are not kiln's and are skipped.

    python3 scripts/check_layering.py [--root REPOSITORY]

Exits 0 when no include climbs; otherwise prints each one as file:line, the include and both layers,
and exits 1. Standard library only, so CI can run it before anything is built.
"""
import argparse
import pathlib
import re
import sys

# The layers of csrc/, lowest first: a folder may include folders of its own layer and of any layer below.
LAYERS = [
    ["common"],                            # errors, logging, hashing, sources: what every layer uses
    ["bytecode", "graph"],                 # the two IRs: CPython bytecode, and the ATen-level graph
    ["frame", "guards", "decomp"],         # the torch-free PEP 523 hook (bytecode/, common/), guards, ATen -> prims
    ["passes"],                            # graph-to-graph rewrites and their pipeline
    ["autodiff", "fusion", "device_lib"],  # joint forward/backward graphs, kernel schedules + loop IR, device helpers
    ["cache"],                             # the on-disk store and the compiled artefact it serialises
    ["codegen"],                           # loop IR -> CUDA C (NVRTC, the CUDA driver) and C++ (system compiler)
    ["runtime"],                           # loads and executes artefacts on torch's allocator and streams
    ["export"],                            # the C++ loader of exported programs (include/kiln/export.h): no Python
    ["compile"],                           # the pipeline: options in, an artefact out, handed to runtime/ to run
    ["trace"],                             # the symbolic interpreter that captures graphs from frames
    ["bindings", "tools"],                 # the module definitions and stand-alone executables: nothing includes them
]

# Includes the table allows (they go down) that the design still rules out, each with its reason.
FORBIDDEN = [
    ("runtime", "frame",
     "runtime/ executes artefacts and must not know the frame hook that captures them "
     "(the layer above injects what runtime needs of it)"),
]

# Quoted includes that are not kiln's folders: CPython's internal headers (pycore_*.h).
FOREIGN_FOLDERS = {"internal"}

# kiln's public headers (include/<folder>/), each at the layer of the csrc/ folder that implements it.
PUBLIC_HEADER_FOLDERS = {"kiln": "export"}  # include/kiln/export.h: the C++ loader of exported programs

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def layer_of_folder():
    return {folder: index for index, folders in enumerate(LAYERS) for folder in folders}


def describe(folder, layers):
    return f"{folder} (layer {layers[folder]})"


def check(root):
    """Returns (violations, number of includes checked); a violation is one printable line."""
    layers = layer_of_folder()
    forbidden = {(src, dst): reason for src, dst, reason in FORBIDDEN}
    csrc = root / "csrc"
    if not csrc.is_dir():
        sys.exit(f"check_layering: {csrc} is not a folder (pass the repository with --root)")
    violations = []
    checked = 0
    for path in sorted(p for p in csrc.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        parts = path.relative_to(csrc).parts
        source = parts[0] if len(parts) > 1 else None
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            match = INCLUDE.match(line)
            if not match or "/" not in match.group(1):
                continue  # a header beside the including file: the same folder
            include = match.group(1)
            target = include.split("/", 1)[0]
            target = PUBLIC_HEADER_FOLDERS.get(target, target)
            if target in FOREIGN_FOLDERS:
                continue
            checked += 1
            where = f'{relative}:{number}: #include "{include}"'
            if source not in layers:
                violations.append(f"{where}: the including folder {source or 'csrc/'} has no layer in LAYERS")
            elif target not in layers:
                violations.append(f"{where}: {target}/ has no layer in LAYERS (add it, or to FOREIGN_FOLDERS)")
            elif target == source:
                continue
            elif layers[target] > layers[source]:
                violations.append(f"{where}: {describe(source, layers)} includes {describe(target, layers)}, "
                                  "a higher layer")
            elif (source, target) in forbidden:
                violations.append(f"{where}: {describe(source, layers)} may not include "
                                  f"{describe(target, layers)}: {forbidden[(source, target)]}")
    return violations, checked


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent,
                        help="the repository to check (default: the one holding this script)")
    args = parser.parse_args()
    violations, checked = check(args.root.resolve())
    for violation in violations:
        print(violation)
    if violations:
        print(f"check_layering: {len(violations)} of {checked} includes break the layering "
              f"(the layers: LAYERS and FORBIDDEN in scripts/{pathlib.Path(__file__).name})")
        return 1
    print(f"check_layering: none of {checked} includes climbs a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
