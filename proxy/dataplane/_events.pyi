# The compiled twin of proxy.dataplane.sse.SSEParser (proxy/dataplane/_events.c),
# of proxy.dataplane.generation.parses_to_object, and of
# proxy.dataplane.continuation.book.hide_ids_reference.
from collections.abc import Callable
from typing import Any

from proxy.dataplane.sse import Relayed

class Parser:
    def __init__(self) -> None: ...
    def feed(self, chunk: bytes) -> list[bytes]: ...
    def relay(self, chunk: bytes, base: int, wants_ids: bool) -> Relayed: ...

def bind(error: type[Exception], max_event: int, /) -> None: ...
def is_object(raw: bytes, /) -> bool: ...
def hide_ids(data: bytes, /) -> bytes: ...

class Stream:
    armed: bool
    drain: bool
    @property
    def heard_at(self) -> float: ...
    def __init__(
        self,
        parser: Parser,
        book: Any,
        transport: Callable[[], Any],
        chunked: bool,
        run: Callable[..., bool],
        slow: Callable[[bytes], bool],
        rest: Callable[[Relayed], bool],
        armable: Callable[[], bool],
        high_water: int,
        slack: int,
        /,
    ) -> None: ...
    def __call__(self, chunk: bytes, /) -> bool: ...
