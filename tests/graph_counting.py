"""A graph backend that counts a StepGraphs' captures and replays: what tests/test_cuda.py and
benchmarks/gpu/profile_batches.py read of the graphs' work (a test aid: the package does not import it)."""
from typing import Callable, Optional

from rfa_fairseq.modules.decoding import StepGraphs


class CountingBackend:
    """A graph backend counting the captures and replays of the one it wraps."""

    def __init__(self, backend):
        self.backend, self.captures, self.replays = backend, 0, 0

    @classmethod
    def of(cls, graphs: Optional[StepGraphs]) -> Optional["CountingBackend"]:
        """The counting backend of `graphs` (its backend wrapped at the first call, counting from then on), or None
        where there are no graphs."""
        if graphs is None:
            return None
        if not isinstance(graphs.backend, cls):
            graphs.backend = cls(graphs.backend)
        return graphs.backend

    def reset(self) -> None:
        self.backend.reset()

    def capture(self, step: Callable[[], object]):
        self.captures += 1
        return self.backend.capture(step)

    def replay(self, graph, outputs) -> None:
        self.replays += 1
        self.backend.replay(graph, outputs)
