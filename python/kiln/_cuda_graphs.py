"""Recording and replaying CUDA graphs for mode="reduce-overhead" through torch's CUDA graph object.

kiln's runtime (csrc/runtime/cuda_graphs.cpp) decides what to record, when, and which memory each recording may
touch; this module only starts and ends a recording (bindings/module_cuda_graphs.cpp calls it). A recording runs on a
side stream, as torch.cuda.graph does: CUDA cannot capture the legacy default stream, and the caller's stream must
see the recording's work ordered after its own."""
import torch

_side_streams = {}


def new_pool():
    """A memory pool shared by the recordings of one compiled model."""
    return torch.cuda.graph_pool_handle()


class Recording:
    """One recording in progress: begun in __init__, ended by end()."""

    def __init__(self, pool, device):
        self.device = torch.device("cuda", device)
        self.caller = torch.cuda.current_stream(self.device)
        side = _side_streams.get(device)
        if side is None:
            side = _side_streams[device] = torch.cuda.Stream(self.device)
        self.side = side
        side.wait_stream(self.caller)
        self.stream_context = torch.cuda.stream(side)
        self.stream_context.__enter__()
        try:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: an unsafe call (a host synchronisation) on this thread fails the recording, while other
            # threads (the autograd engine's, a data loader's) go on as usual.
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
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
