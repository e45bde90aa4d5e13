"""Streams that outlive a fault: bookkeeping, the continuation, the splice.

``fields`` decides every request field's fate in a continuation; ``book``
records what a stream sent and builds and splices the continuation. Pure
logic, no I/O: the hold-open machinery (:mod:`proxy.dataplane.hold`) does that.
"""

from proxy.dataplane.continuation.book import (
    ABORT,
    CHAT,
    COMPLETION,
    Book,
    Emit,
    Overrun,
    hide_ids,
    text_of,
)
from proxy.dataplane.continuation.fields import Refusal, as_bool, refusal
from proxy.dataplane.continuation.splice import SpliceFailed

__all__ = [
    "ABORT",
    "CHAT",
    "COMPLETION",
    "Book",
    "Emit",
    "Overrun",
    "Refusal",
    "SpliceFailed",
    "as_bool",
    "hide_ids",
    "refusal",
    "text_of",
]
