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
  beyond the client's is text it is owed (an abort chunk's: its tokens' and
  what vLLM held back for a possible stop match, flushed) or what vLLM held
  back and lost with the connection: it is the client's, sent with the
  continuation's. So the boundary at the end of everything the client has
  or is owed is always usable when its text is whole.

``/detokenize`` keeps special tokens (vLLM 0.32's request has no
``skip_special_tokens``) while the stream skips them by default. Ids the
stream showed as one token with no text, and which decode alone to whole
text, are special: they are left out before decoding. So is a token whose
text the ids say where the stream's text says something else (vLLM merged
a special token into a chunk with others). Whatever cannot be told apart
fails the agreement check, and an earlier boundary is used.

Greedy requests may go back to any boundary (token 0 always qualifies: the
prompt itself). Sampled requests cannot generate the same tokens again: they
go back only over tokens the client has neither text nor ids of, to any
boundary, not only a chunk's (vLLM merges tokens into one chunk): one fails
only where the client has a token of a character not yet whole (its id, or
its text: a token can end one character and start the next).

vLLM looks for stop strings in its own output only. A boundary is *open*
when a stop string could start in its text and end in the continuation's:
vLLM would not see it whole. (A sampled continuation says something else
after the boundary than the ids it goes back over did: text vLLM showed
because those followed it may start one.) Among usable boundaries the latest closed one
is taken, so the engine finds the stop itself, at its own token; greedy
requests always have one (token 0). An open boundary is taken only when no
closed one is usable (sampled), and the proxy then matches across it
(:meth:`~proxy.dataplane.continuation.Book.on_continuation`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Decode = Callable[[list[int]], Awaitable[str]]

# Prompt ids decoded with the generated ones: the first token's text depends
# on what precedes it (a leading space in SentencePiece). vLLM's incremental
# detokenizer starts from the same offset.
CONTEXT = 5
# Boundaries tried before a greedy request goes back to its prompt.
TRIES = 6
# Boundaries a sampled request tries (every one, from the latest): its
# client's text ends within the last few ids, or no boundary is usable.
SAMPLED_TRIES = 16
# Special token kinds looked for where the stream's text and the ids' part.
SPECIALS_FOUND_MAX = 4
REPLACEMENT = "\ufffd"
# A character's tokens at most: UTF-8 has 4 bytes a character, a token 1 at least.
CHAR_TOKENS_MAX = 4


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
    recovered: str  # text of the kept ids the client is owed (an abort's, held back and lost)
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
    *,
    prompt: list[int],
    generated: list[int],
    marks: list[tuple[int, int]],
    visible: str,
    owed: str = "",
    suspects: set[int],
    greedy: bool,
    lowest: int,
    skip_special: bool,
    stops: list[str],
    decode: Decode,
) -> Boundary:
    """The latest usable boundary at or above ``lowest``, closed if one is
    usable. ``visible`` is the text the client has, ``owed`` the text it is
    owed after it (an abort chunk's, text held back for a stop match).
    Greedy requests try the chunk boundaries ``marks`` (ids, text length);
    sampled ones every boundary from the latest down, since the client's
    text may end inside a chunk (vLLM merged tokens into it) and only a
    boundary at its end is usable. Past ``visible`` and ``owed``, vLLM held
    back at most a stop string's length less one characters, lost with the
    connection: more is not held-back text but a decoding the stream did not
    do (an unrecognized special token)."""
    held_max = max((len(s) - 1 for s in stops), default=0)
    ctx = prompt[-CONTEXT:]
    dec = _Decoder(ctx, await decode(ctx) if ctx else "", decode)
    n = len(generated)
    texts: dict[int, str | None] = {0: ""}
    if skip_special:
        texts[n] = await _specials(dec, generated, suspects, visible + owed, held_max)
    full = None
    if stops:
        if texts.get(n) is None:
            texts[n] = await dec.text(generated)
        whole = texts[n]
        # A character not yet whole has no text in vLLM's output: not checked.
        full = whole.rstrip(REPLACEMENT) if whole is not None else None
    fallback: Boundary | None = None
    for k in _candidates(marks, len(generated), lowest, greedy):
        if k not in texts:
            texts[k] = await dec.text(generated[:k])
        text = texts[k]
        if text is None or text.endswith(REPLACEMENT):
            continue
        if not greedy and len(text) < len(visible) and visible.startswith(text):
            break  # earlier boundaries say less than the client has: none is usable
        b = _usable(k, text, visible, owed, greedy, held_max)
        if b is None:
            continue
        # A fresh sample says something else after ``text`` than the ids
        # did: only a greedy continuation says their text again.
        b.open = opens_stop(text, full if greedy else None, stops)
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


@dataclass
class _Decoder:
    """Token ids to their text as the stream shows it: decoded after the
    prompt's last ids ``ctx`` (whose own text is ``base``), without the
    special tokens found so far."""

    ctx: list[int]
    base: str
    decode: Decode
    specials: set[int] = field(default_factory=set)

    async def text(self, ids: list[int]) -> str | None:
        full = await self.decode(self.ctx + [t for t in ids if t not in self.specials])
        return full[len(self.base) :] if full.startswith(self.base) else None


async def _specials(
    dec: _Decoder, generated: list[int], suspects: set[int], said: str, held_max: int
) -> str | None:
    """Find the special tokens among ``generated`` (into ``dec.specials``),
    whose text the stream skips (``skip_special_tokens``) and ``/detokenize``
    keeps, and return the text of the others. Special: the ids it showed
    alone with no text that decode alone to whole text; then, while the ids'
    text says more than the stream's (``said``) where they part, the token
    whose text begins there (vLLM merges a special token into a chunk with
    others, whose text is theirs only). Past the end of ``said`` the first
    such token's text may be text vLLM held back for a stop string, the
    client's: only a token whose text is longer than that (``held_max``) is
    taken for special there."""
    for t in sorted(suspects & set(generated)):
        alone = await dec.decode([t])
        if alone and REPLACEMENT not in alone:
            dec.specials.add(t)
    whole: str | None = None
    for _ in range(SPECIALS_FOUND_MAX):
        whole = await dec.text(generated)
        if whole is None:
            break
        full = whole.rstrip(REPLACEMENT)
        i = _parting(full, said)
        if i == len(full) or (i == len(said) and len(full) - i <= held_max):
            break  # they agree; past ``said``, text vLLM held back
        first = await _char_start(dec, generated, await _reaching(dec, generated, i))
        tail = held_max if i == len(said) else 0
        special = await _special_from(dec, generated[first:], full, i, tail)
        if special is None:
            break
        dec.specials.add(special)
        whole = None
    return whole


async def _special_from(
    dec: _Decoder, tokens: list[int], full: str, i: int, held: int
) -> int | None:
    """The one of ``tokens`` whose text starts where the ids' text ``full``
    has more than the stream's (at ``i``, or after ``held`` characters of
    held-back text before it), and is longer than ``held``: text that
    ``held`` held-back characters cannot be. A character of several tokens
    ("€" of three byte tokens) is taken whole: none of its tokens alone is
    text, and none of them is a special token."""
    at, char = i, []
    for t in tokens:
        if t in dec.specials:
            continue
        char.append(t)
        alone = await dec.decode(char)
        if alone.endswith(REPLACEMENT) and len(char) < CHAR_TOKENS_MAX:
            continue  # a piece of a character: the next token may end it
        if not alone or REPLACEMENT in alone or not full.startswith(alone, at):
            return None
        if len(alone) > held:
            return t if len(char) == 1 else None
        at += len(alone)
        char = []
        if at - i > held:
            return None
    return None


async def _char_start(dec: _Decoder, tokens: list[int], k: int) -> int:
    """``k``, or the first token of the character that ``tokens[k]`` ends
    (whose earlier tokens leave text ending in U+FFFD)."""
    for _ in range(CHAR_TOKENS_MAX - 1):
        if k == 0:
            break
        text = await dec.text(tokens[:k])
        if text is None or not text.endswith(REPLACEMENT):
            break
        k -= 1
    return k


def _parting(a: str, b: str) -> int:
    """Where ``a`` and ``b`` part: the length of their common start."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def _reaching(dec: _Decoder, tokens: list[int], chars: int) -> int:
    """The first of ``tokens`` whose text takes their text past ``chars`` characters."""
    lo, hi = 0, len(tokens) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        text = await dec.text(tokens[: mid + 1])
        if text is not None and len(text.rstrip(REPLACEMENT)) > chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _candidates(marks: list[tuple[int, int]], n: int, lowest: int, greedy: bool) -> list[int]:
    """The boundaries to try, latest first."""
    if not greedy:
        return list(range(n, lowest - 1, -1))[:SAMPLED_TRIES]
    ks = sorted({k for k, _ in marks if k <= n}, reverse=True)
    return ks[:TRIES] + ([0] if 0 in ks[TRIES:] else [])


def _usable(
    k: int, text: str, visible: str, owed: str, greedy: bool, held_max: int
) -> Boundary | None:
    """Boundary ``k`` (its ids decode to ``text``) if it agrees with the
    client: it has, or is owed, all of ``text``."""
    if visible.startswith(text):
        skip = visible[len(text) :]
        if skip and not greedy:
            return None  # a fresh sample would not say it again
        return Boundary(k, text, skip, "")
    if not text.startswith(visible):
        return None
    extra = text[len(visible) :]
    if owed.startswith(extra) or (extra.startswith(owed) and len(extra) - len(owed) <= held_max):
        return Boundary(k, text, "", extra)
    return None
