"""torch's Python meta kernels, as kiln's recorder (kiln/_fake.py) meets them where kiln's own shape rules
(csrc/graph/shape_rules*.cpp) give no answer: which ops have one, and the torch._disable_dynamo wrappers around them,
whose first call would import torch._dynamo."""
import torch

wrappers_patched = False


def has_python_meta(qualified):
    """Whether the dispatcher's Meta kernel of `qualified` ("aten::add.Tensor") was registered from Python (views
    and composites reach none; most others reach torch._meta_registrations'). Unknown counts as Python."""
    name = qualified[:-len(".default")] if qualified.endswith(".default") else qualified
    try:
        dump = torch._C._dispatch_dump(name)
    except RuntimeError:
        return True
    for line in dump.splitlines():
        if line.startswith("Meta:"):
            return ".py:" in line or "python" in line.lower()
    return False  # no Meta kernel of its own: a composite or a view that decomposes in C++


def avoid_dynamo_import():
    """torch wraps hundreds of its Python meta kernels and decompositions with torch._disable_dynamo,
    whose wrapper imports torch._dynamo on first call (over a second of cold start, for a compiler kiln
    never uses). Give each such wrapper a ready "disabled" version that calls the function directly while
    torch._dynamo is not loaded, and defers to torch._dynamo.disable once it is (torch.compile in the same
    process keeps its behaviour). Runs once (about 25 ms), before the first op kiln's own rules
    (csrc/graph/shape_rules*.cpp) leave to torch's meta kernels."""
    global wrappers_patched
    if wrappers_patched:
        return
    wrappers_patched = True
    import gc
    import sys
    import torch._compile as compile_module

    wrapper_code = None
    probe = compile_module._disable_dynamo(lambda: None)
    wrapper_code = getattr(probe, "__code__", None)
    if wrapper_code is None or wrapper_code.co_freevars[:2] != ("fn", "recursive"):
        return  # a torch whose wrapper looks different: leave it alone

    def lazy_disable(fn, recursive):
        real = None

        def call(*args, **kwargs):
            nonlocal real
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:
                return fn(*args, **kwargs)
            if real is None:
                real = dynamo.disable(fn, recursive, wrapping=False)
            return real(*args, **kwargs)
        # Still torch.compiler.disable'd for kiln while torch._dynamo is not loaded: the tracer breaks at a call of it
        # and the frame hook suspends kiln for what it calls (recursive) or for its own frame, as for DisableContext's
        # wrapper. Without these marks a disabled function ran compiled, or was traced inline, only after this patch
        # had run: torch.utils.checkpoint then compiled its function in the forward while the backward recomputed it
        # eagerly, and the two saved different tensors (CheckpointError).
        call._torchdynamo_disable = True
        call._torchdynamo_disable_recursive = recursive
        return call

    for obj in gc.get_objects():
        if type(obj) is type(probe) and obj.__code__ is wrapper_code and obj.__closure__:
            fn, recursive = (cell.cell_contents for cell in obj.__closure__[:2])
            if getattr(fn, "__dynamo_disable", None) is None:
                try:
                    fn.__dynamo_disable = lazy_disable(fn, recursive)
                except (AttributeError, TypeError):
                    pass
