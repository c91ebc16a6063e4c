"""The disk cache trusts only what the user alone can write (csrc/cache/kernel_cache.h).

kiln dlopens the C++ libraries it finds in KILN_CACHE_DIR, so a library someone else could have put there must
never load. Each case runs kiln in a new process, as a warm start would: a refused cache stays off for the whole
process, and its one warning goes to stderr. Keys are SHA-256 digests, checked here with Python's hashlib.
"""
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys, torch, kiln
    from kiln.testing import assert_same_as_eager, random_tensor

    def f(x):
        return torch.tanh(x * {scale} + 1).sum(-1)

    with torch.no_grad():
        assert_same_as_eager(f, random_tensor(8, 16), grads=False)
    cache = sys.argv[1]
    with open("/proc/self/maps") as maps:
        mapped = any(cache + "/" in line for line in maps)  # a library in the cache is loaded
    s = kiln._C.compiler_stats()
    print(s["kernels_compiled"], s["cache_hits"], s["graph_cache_hits"], mapped)
""")


def run_child(cache, scale=2, env=None):
    """(stdout words, kiln's warning lines) of CHILD run with KILN_CACHE_DIR=cache (env: the whole environment)."""
    env = env if env is not None else dict(os.environ, KILN_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.path.join(REPO_ROOT, "python")
    done = subprocess.run([sys.executable, "-c", CHILD.format(scale=scale), str(cache)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("[kiln] warning:")]
    return done.stdout.split(), warnings


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache that one process filled (kiln creates the folder): its library and graph record."""
    cache = tmp_path_factory.mktemp("warm") / "kiln" / "cache"
    words, warnings = run_child(cache)
    assert words == ["1", "0", "0", "True"] and not warnings, (words, warnings)  # built into the cache, loaded there
    return cache


def library_of(cache):
    (name,) = [n for n in os.listdir(cache / "cpp") if n.endswith(".so")]
    return cache / "cpp" / name


def test_new_cache_directories_are_private(warm_cache):
    for path in (warm_cache.parent, warm_cache, warm_cache / "cpp", warm_cache / "graphs"):
        assert mode(path) == 0o700, path
    for name in os.listdir(warm_cache / "cpp"):
        assert mode(warm_cache / "cpp" / name) & 0o022 == 0, name


def test_keys_and_checksums_are_sha256(warm_cache, tmp_path):
    for kind, suffix in (("cpp", ".so"), ("cpp", ".cpp"), ("graphs", ".kgraph")):
        (name,) = [n for n in os.listdir(warm_cache / kind) if n.endswith(suffix)]
        assert re.fullmatch(r"[0-9a-f]{64}" + re.escape(suffix), name), name
        content = (warm_cache / kind / name).read_bytes()
        checksum = (warm_cache / kind / (name + ".sum")).read_text()
        assert checksum == f"{len(content)} {hashlib.sha256(content).hexdigest()}"
    # Another source is another key.
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    assert run_child(cache, scale=3)[0][:2] == ["1", "0"]
    libraries = sorted(n for n in os.listdir(cache / "cpp") if n.endswith(".so"))
    assert len(libraries) == 2 and library_of(warm_cache).name in libraries


def test_a_cache_other_users_can_write_to_is_not_used(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    words, warnings = run_child(shared)
    assert words == ["1", "0", "0", "False"], words  # compiled in memory, answers as eager (in the child)
    assert len(warnings) == 1 and str(shared) in warnings[0] and "writable by other users" in warnings[0], warnings
    assert os.listdir(shared) == []  # nothing written


def give_away(library):
    os.chown(library, 65534, 65534)  # nobody


def make_group_writable(library):
    os.chmod(library, 0o664)


def replace_with_link(library):
    target = library.parent.parent / "elsewhere.so"
    os.rename(library, target)
    os.symlink(target, library)


def open_its_directory(library):
    os.chmod(library.parent, 0o777)


@pytest.mark.parametrize("tamper, problem", [
    (give_away, "belongs to uid 65534"),
    (make_group_writable, "writable by other users (mode 0664)"),
    (replace_with_link, "is a symbolic link"),
    (open_its_directory, "writable by other users (mode 0777)"),
], ids=["foreign-owner", "group-writable", "symlink", "world-writable-directory"])
def test_an_untrusted_library_is_not_loaded(warm_cache, tmp_path, tamper, problem):
    if tamper is give_away and os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache, symlinks=True)
    library = library_of(cache)
    tamper(library)  # its content and checksum are still right: only who could have written it is wrong
    before = os.lstat(library)
    words, warnings = run_child(cache)
    # The graph record is read (it is trusted), its library is refused and built again in memory.
    assert words == ["1", "0", "1", "False"], words
    named = str(library.parent if tamper is open_its_directory else library)
    assert len(warnings) == 1 and named in warnings[0] and problem in warnings[0], warnings
    after = os.lstat(library)
    assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, before.st_uid, before.st_mode)  # not replaced


def test_without_home_the_cache_is_a_private_folder_in_tmpdir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "KILN_CACHE_DIR")}
    env["TMPDIR"] = str(tmp_path)
    root = tmp_path / f"kiln-{os.geteuid()}"
    words, warnings = run_child(root, env=env)
    assert words == ["1", "0", "0", "True"] and not warnings, (words, warnings)
    assert mode(root) == 0o700 and mode(root / "cpp") == 0o700
    assert any(n.endswith(".so") for n in os.listdir(root / "cpp"))


CUDA_CHILD = textwrap.dedent("""
    import torch, kiln
    from kiln.testing import assert_same_as_eager, random_tensor
    with torch.no_grad():
        assert_same_as_eager(lambda x: torch.softmax(x * 3, -1), random_tensor(64, 333, device="cuda"), grads=False)
    s = kiln._C.cuda.program_cache_stats()
    print(s["compiled"], s["disk_hits"])
""")


@pytest.mark.cuda
def test_an_untrusted_cuda_image_is_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, KILN_CACHE_DIR=str(cache), PYTHONPATH=os.path.join(REPO_ROOT, "python"))

    def run():
        done = subprocess.run([sys.executable, "-c", CUDA_CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return [int(v) for v in done.stdout.split()], [line for line in done.stderr.splitlines()
                                                       if line.startswith("[kiln] warning:")]

    (compiled, disk_hits), warnings = run()
    assert compiled >= 1 and disk_hits == 0 and not warnings
    images = [cache / "cuda" / n for n in os.listdir(cache / "cuda") if n.endswith((".cubin", ".ptx"))]
    assert len(images) == compiled and all(re.fullmatch(r"[0-9a-f]{64}\.(cubin|ptx)", p.name) for p in images)
    make_group_writable(images[0])
    # The graph record comes from disk; the refused image is compiled again by NVRTC (images read on other threads
    # before the refusal may still come from disk).
    (compiled_again, disk_hits), warnings = run()
    assert compiled_again >= 1 and compiled_again + disk_hits == compiled, (compiled_again, disk_hits)
    assert len(warnings) == 1 and str(images[0]) in warnings[0] and "mode 0664" in warnings[0], warnings
