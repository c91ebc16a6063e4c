"""Recording and replaying CUDA graphs for mode="reduce-overhead" through torch's CUDA graph object.

kiln's runtime (csrc/runtime/cuda_graphs.cpp) decides what to record, when, and which memory each recording may
touch; this module only makes a pool and starts and ends a recording (bindings/module_cuda_graphs.cpp calls it). A
recording runs on a side stream, as torch.cuda.graph does: CUDA cannot capture the legacy default stream, and the
caller's stream must see the recording's work ordered after its own."""
import torch

_side_streams = {}


def _side_stream(device):
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    return side


class Pool:
    """The memory pool of one compiled model's recordings on one device.

    torch's allocator drops a graph pool when the last graph recorded into it is destroyed, and asserts if a later
    recording names it again. kiln replaces recordings (an input that moved), so the pool holds an anchor: a tiny
    recording of its own that lives as long as the pool."""

    def __init__(self, device):
        self.device = torch.device("cuda", device)
        self.handle = torch.cuda.graph_pool_handle()
        recording = Recording(self)
        self._anchor_memory = torch.empty(1, device=self.device).fill_(0)
        self._anchor = recording.end()


class Recording:
    """One recording in progress into `pool`: begun in __init__, ended by end()."""

    def __init__(self, pool):
        device = pool.device
        self.caller = torch.cuda.current_stream(device)
        self.side = _side_stream(device)
        self.side.wait_stream(self.caller)
        self.stream_context = torch.cuda.stream(self.side)
        self.stream_context.__enter__()
        try:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: an unsafe call (a host synchronisation) on this thread fails the recording, while other
            # threads (the autograd engine's, a data loader's) go on as usual.
            self.graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
        except BaseException:
            self.stream_context.__exit__(None, None, None)
            raise

    def end(self):
        """Ends the recording; returns the graph, or raises when the recording failed."""
        try:
            self.graph.capture_end()
        finally:
            self.stream_context.__exit__(None, None, None)
            self.caller.wait_stream(self.side)
        return self.graph
