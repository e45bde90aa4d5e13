"""Where a continuation starts: a character boundary decided from token ids.

Which chunk carried text says nothing certain about where a character ends:
vLLM merges tokens into one chunk under load, a token can finish one
character and start the next, and with stop strings it holds text back. So
at splice time the ids are decoded by the rank itself (``POST /detokenize``)
and the continuation starts at the latest chunk boundary ``k`` whose text

* is whole: it does not end inside a character (U+FFFD), so vLLM's decoder
  never sees a token-id prompt that ends mid-character (it then echoes the
  prompt into the output), and
* agrees with what the client has seen: one is a prefix of the other. The
  client's text beyond it is generated again and skipped (greedy only); text
  beyond the client's is what vLLM held back for a possible stop match and
  lost with the connection: it is recovered.

``/detokenize`` keeps special tokens (vLLM 0.32's request has no
``skip_special_tokens``) while the stream skips them by default. Ids the
stream showed as one token with no text, and which decode alone to whole
text, are special: they are left out before decoding. Whatever cannot be
told apart fails the agreement check, and an earlier boundary is used.

Greedy requests may go back to any boundary (token 0 always qualifies: the
prompt itself). Sampled requests cannot generate the same tokens again: they
go back only over tokens the client has neither text nor ids of.

vLLM looks for stop strings in its own output only. A boundary is *open*
when a stop string could start in its text and end in the continuation's:
vLLM would not see it whole. Among usable boundaries the latest closed one
is taken, so the engine finds the stop itself, at its own token; greedy
requests always have one (token 0). An open boundary is taken only when no
closed one is usable (sampled), and the proxy then matches across it
(:meth:`~proxy.continuation.Book.on_continuation`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Decode = Callable[[list[int]], Awaitable[str]]

# Prompt ids decoded with the generated ones: the first token's text depends
# on what precedes it (a leading space in SentencePiece). vLLM's incremental
# detokenizer starts from the same offset.
CONTEXT = 5
# Boundaries tried before a greedy request goes back to its prompt.
TRIES = 6
REPLACEMENT = "\ufffd"


class SpliceFailed(Exception):
    """The stream cannot be continued exactly; ``code`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Boundary:
    k: int  # generated ids kept; the continuation's prompt ends there
    text: str  # their text, as the stream shows it
    skip: str  # client text the continuation generates again
    recovered: str  # text vLLM held back and lost: the client's now
    open: bool = False  # a stop string may start in its text and end after it


def opens_stop(text: str, full: str | None, stops: list[str]) -> bool:
    """Whether a continuation from ``text`` could complete a stop string that
    starts inside ``text``, where vLLM would not see it.

    ``full`` is the text of every id the stream has (``text`` is a prefix of
    it): vLLM checked it, so a stop string still to come ends after it; what
    follows ``text`` the continuation generates again, and vLLM sees that.
    """
    if full is None or not full.startswith(text):
        full = text  # not known: as if nothing came after ``text``
    again = len(full) - len(text)
    return any(full.endswith(s[:j]) for s in stops for j in range(again + 1, len(s)))


async def find_boundary(
    *, prompt: list[int], generated: list[int], marks: list[tuple[int, int]], visible: str,
    suspects: set[int], greedy: bool, lowest: int, skip_special: bool, stops: list[str],
    decode: Decode,
) -> Boundary:  # fmt: skip
    """The latest usable boundary among ``marks`` (ids, text length) at or
    above ``lowest``, closed if one is usable; ``visible`` is the text the
    client has or will get. vLLM holds back at most a stop string's length
    less one characters: more text than that beyond ``visible`` is not
    held-back text but a decoding the stream did not do (an unrecognized
    special token)."""
    held_max = max((len(s) - 1 for s in stops), default=0)
    ctx = prompt[-CONTEXT:]
    base = await decode(ctx) if ctx else ""
    specials: set[int] = set()
    if skip_special:
        for t in sorted(suspects & set(generated)):
            alone = await decode([t])
            if alone and REPLACEMENT not in alone:
                specials.add(t)
    candidates = sorted({k for k, _ in marks if lowest <= k <= len(generated)}, reverse=True)
    tries = candidates[:TRIES] + ([0] if greedy and 0 in candidates[TRIES:] else [])
    texts: dict[int, str | None] = {0: ""}
    full = None
    if stops:
        texts[len(generated)] = whole = await _text(ctx, base, generated, specials, decode)
        # A character not yet whole has no text in vLLM's output: not checked.
        full = whole.rstrip(REPLACEMENT) if whole is not None else None
    fallback: Boundary | None = None
    for k in tries:
        if k not in texts:
            texts[k] = await _text(ctx, base, generated[:k], specials, decode)
        text = texts[k]
        if text is None or text.endswith(REPLACEMENT):
            continue
        b = _usable(k, text, visible, greedy, held_max)
        if b is None:
            continue
        b.open = opens_stop(text, full, stops)
        if not b.open:
            return b
        fallback = fallback or b
    if fallback is not None:
        return fallback
    raise SpliceFailed(
        "split_character",
        "the fault came inside a character whose tokens the client already has, "
        "and a sampled request cannot generate them again",
    )


def _usable(k: int, text: str, visible: str, greedy: bool, held_max: int) -> Boundary | None:
    """Boundary ``k`` (its ids decode to ``text``) if it agrees with the client."""
    if visible.startswith(text):
        skip = visible[len(text) :]
        if skip and not greedy:
            return None  # a fresh sample would not say it again
        return Boundary(k, text, skip, "")
    if text.startswith(visible) and len(text) - len(visible) <= held_max:
        return Boundary(k, text, "", text[len(visible) :])
    return None


async def _text(
    ctx: list[int], base: str, ids: list[int], specials: set[int], decode: Decode
) -> str | None:
    full = await decode(ctx + [t for t in ids if t not in specials])
    return full[len(base) :] if full.startswith(base) else None
