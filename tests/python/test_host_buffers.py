"""The CPU host buffer cache (runtime/host_buffers.h): large buffers of compiled CPU graphs are kept between
calls instead of going back to the system, without changing any result a caller can see."""
import threading

import torch

import kiln
from kiln.testing import random_tensor


def stats():
    return kiln._C.host_buffer_stats()


def mlp(x, w1, w2):
    h = torch.relu(x @ w1 + 1)           # 512 x 512 floats: 1 MiB intermediates, cached
    return torch.tanh(h @ w2) * 2, h.sum(0)


def inputs():
    return random_tensor(512, 256), random_tensor(256, 512), random_tensor(512, 256)


def test_second_call_reuses_buffers_and_outputs_stay_distinct():
    kiln.reset()
    f = kiln.compile(mlp)
    a = inputs()
    b = inputs()
    with torch.no_grad():
        out_a = f(*a)
        before = stats()
        kept = [t.clone() for t in out_a]
        out_b = f(*b)
        after = stats()
        assert after["hits"] > before["hits"], (before, after)
        # Call a's outputs are still alive: call b took other blocks, and a's values are untouched.
        for got, want in zip(out_a, kept):
            assert torch.equal(got, want)
        assert out_a[0].data_ptr() != out_b[0].data_ptr()
        for got, want in zip(out_b, mlp(*b)):
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
        for got, want in zip(out_a, mlp(*a)):
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    kiln.reset()


def test_reset_releases_cached_blocks():
    kiln.reset()
    f = kiln.compile(mlp)
    with torch.no_grad():
        out = f(*inputs())
    del out
    assert stats()["cached_bytes"] > 0
    kiln.reset()
    assert stats()["cached_bytes"] == 0


def test_outputs_free_from_another_thread_and_resize():
    kiln.reset()
    f = kiln.compile(mlp)
    with torch.no_grad():
        out, _ = f(*inputs())
        other, _ = f(*inputs())
    in_use = stats()["in_use_bytes"]
    assert in_use > 0
    holder = [out]
    del out
    t = threading.Thread(target=holder.clear)  # the block goes back to the cache from that thread
    t.start()
    t.join()
    assert stats()["in_use_bytes"] < in_use
    first_row = other[0].clone()
    other.resize_(1024, 256)  # the storage grows through torch's allocator and keeps its elements
    assert torch.equal(other[0], first_row)
    other.fill_(1.0)
    assert other.sum().item() == 1024 * 256
    kiln.reset()


def test_allocations_outside_compiled_graphs_are_untouched():
    kiln.reset()
    f = kiln.compile(mlp)
    with torch.no_grad():
        f(*inputs())
    before = stats()
    big = torch.empty(1 << 20)  # 4 MiB, made by the caller: torch's own allocator
    del big
    assert stats() == before
    kiln.reset()


def test_threads_calling_compiled_graphs_get_their_own_buffers():
    kiln.reset()
    f = kiln.compile(mlp)
    failures = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):
            args = [torch.randn(*t.shape, generator=gen) for t in inputs()]
            with torch.no_grad():
                got = f(*args)
                want = mlp(*args)
            for g, w in zip(got, want):
                if not torch.allclose(g, w, rtol=1e-4, atol=1e-4):
                    failures.append((seed, (g - w).abs().max().item()))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    kiln.reset()


def test_forked_child_runs_compiled_graphs():
    # A DataLoader worker is a fork: the child inherits the cache (and takes a fresh lock) and computes right.
    # As in DataLoader's workers, the child runs one intra-op thread (OpenMP's pool does not survive a fork,
    # for eager's kernels as for kiln's).
    import os
    kiln.reset()
    f = kiln.compile(mlp)
    args = inputs()
    with torch.no_grad():
        f(*args)
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(60)  # a hung child fails the test instead of hanging it
            torch.set_num_threads(1)
            ok = all(torch.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(f(*args), mlp(*args)))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    kiln.reset()
