# The compiled decoder of a streamed answer's chunked body (proxy/upstream/_framing.c).

from collections.abc import Callable
from typing import Any

class Dechunker:
    def __init__(self) -> None: ...
    def feed(self, data: bytes, /) -> tuple[bytes, bytes | None]: ...
    def feed_to(self, data: bytes, response: Any, /) -> bytes | None: ...
    @property
    def at_boundary(self) -> bool: ...
    @property
    def broken(self) -> bool: ...
    dry: int

class Reader:
    def __init__(
        self,
        chunks: Dechunker,
        response: Any,
        clock: Callable[[], float],
        rest: Callable[[bytes], None],
        /,
    ) -> None: ...
    def __call__(self, data: bytes, /) -> None: ...
    @property
    def read_at(self) -> float: ...
