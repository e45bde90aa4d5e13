"""One ``/metrics`` for the whole replica with ``--workers N``, without shared files.

Each worker keeps plain in-process metrics: prometheus-client's multiprocess
mode took a file lock and a file write on every metric operation, several per
request. The supervisor names a directory (``FTPROXY_METRICS_DIR``); each
worker answers its own samples, as json, to whoever connects to
``<dir>/<pid>.sock``. The worker that takes a scrape reads its siblings'
(all at once, each bounded in bytes and time; one that does not answer in
time is skipped with a warning) and adds them to its own:

* counters and histograms (buckets, sums and counts) are summed per label set;
* the gauges a worker shares (in flight, queued, held) are its own share of a
  replica-wide total, so they are summed over the workers that answered;
* the rank-table gauges (status, routable, feed age) are not shared: every
  worker computes them from the same polls, and the answering worker's are
  exposed (see ``Metrics.VIEW``).

Counters never go backwards when a worker dies: summed, a dead worker's
counts would vanish from the total, and Prometheus would read the drop as a
reset of the whole replica's counter (and count the whole total again as
new). So whoever scrapes records each worker's counters and histograms as
they were exposed, in ``<dir>/<pid>.last`` (per series the larger of the old
and new value: scrapes on two workers may interleave). When a worker ends
the supervisor folds its ``.last`` into ``<dir>/retired.json``, which every
scrape adds in. A worker alive but not answering counts with its ``.last``.
What a worker counted after the last scrape and before it died is lost,
which Prometheus cannot tell from never having happened; nothing it saw
goes down. Files are read and written under an ``flock`` (``<dir>/lock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import orjson
from prometheus_client import Metric
from prometheus_client.metrics_core import METRIC_TYPES
from prometheus_client.registry import Collector

log = logging.getLogger("ftproxy.metrics")

ENV = "FTPROXY_METRICS_DIR"
# A sibling must connect and send all of its samples within this.
SIBLING_TIMEOUT_S = 1.0
# A worker's samples are a few hundred series (label values are rank names,
# codes and fixed reasons); far more is not a sibling's answer.
MAX_BYTES = 8 << 20

# (sample name, sorted labels)
Key = tuple[str, tuple[tuple[str, str], ...]]


class Family:
    """One metric family's samples, summable with another worker's."""

    __slots__ = ("doc", "kind", "name", "samples")

    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name, self.kind, self.doc = name, kind, doc
        self.samples: dict[Key, float] = {}

    @property
    def monotonic(self) -> bool:
        """Counts that only grow while the worker lives (kept after it dies)."""
        return self.kind in ("counter", "histogram")

    def add(self, key: Key, value: float) -> None:
        self.samples[key] = self.samples.get(key, 0.0) + value

    def metric(self) -> Metric:
        m = Metric(self.name, self.doc, self.kind)
        for (sample, labels), value in self.samples.items():
            m.add_sample(sample, dict(labels), value)
        return m


Families = dict[str, Family]


def from_metrics(metrics: Iterable[Metric]) -> Families:
    """A worker's own families as collected, ``_created`` left out: a sum of
    creation times means nothing (multiprocess mode had none either)."""
    out: Families = {}
    for m in metrics:
        fam = out[m.name] = Family(m.name, m.type, m.documentation)
        for s in m.samples:
            if not s.name.endswith("_created"):
                fam.add((s.name, tuple(sorted(s.labels.items()))), s.value)
    return out


def dumps(fams: Families) -> bytes:
    return orjson.dumps(
        [
            [
                f.name,
                f.kind,
                f.doc,
                [[s, list(map(list, lb)), v] for (s, lb), v in f.samples.items()],
            ]
            for f in fams.values()
        ]
    )


def loads(raw: bytes) -> Families:
    """A sibling's or a file's families; ValueError (or its subclasses) if not of that shape."""
    out: Families = {}
    for name, kind, doc, samples in orjson.loads(raw):
        if kind not in METRIC_TYPES:  # exposing it would fail the whole scrape
            raise ValueError(f"{str(name)[:60]!r}: no metric type {str(kind)[:20]!r}")
        fam = out[str(name)] = Family(str(name), kind, str(doc))
        for sample, labels, value in samples:
            # Sorted as from_metrics sorts them: one series, one key.
            key = tuple(sorted((str(k), str(v)) for k, v in labels))
            fam.add((str(sample), key), float(value))
    return out


def add(into: Families, more: Families, monotonic_only: bool = False) -> None:
    """Sum ``more`` into ``into``, series by series (a family new to ``into`` is appended)."""
    for name, fam in more.items():
        if monotonic_only and not fam.monotonic:
            continue
        mine = into.get(name)
        if mine is None:
            mine = into[name] = Family(name, fam.kind, fam.doc)
        for key, value in fam.samples.items():
            mine.add(key, value)


def copy(fams: Families, monotonic_only: bool = False) -> Families:
    out: Families = {}
    add(out, fams, monotonic_only)
    return out


def _highest(old: Families, new: Families) -> Families:
    """Per series the larger value: a scrape that read a worker earlier may write after one that
    read it later."""
    out = copy(new, monotonic_only=True)
    for name, fam in old.items():
        mine = out.get(name)
        if mine is None:
            out[name] = fam
            continue
        for key, value in fam.samples.items():
            if value > mine.samples.get(key, value - 1):
                mine.samples[key] = value
    return out


class Exposition(Collector):
    """Families to hand to prometheus_client's ``generate_latest``."""

    def __init__(self, fams: Families) -> None:
        self.fams = fams

    def collect(self) -> Iterator[Metric]:
        for f in self.fams.values():
            yield f.metric()


# -- files: the last exposed counts of each worker, and of the dead ----------
@contextlib.contextmanager
def _locked(folder: Path, wait_s: float | None = None) -> Iterator[None]:
    """The files' lock; with ``wait_s``, TimeoutError if a process (stopped,
    frozen) holds it longer: a scrape is bounded, and holds no thread for good."""
    with (folder / "lock").open("a") as f:
        if wait_s is None:
            fcntl.flock(f, fcntl.LOCK_EX)
        else:
            _flock_within(f.fileno(), wait_s)
        yield  # closing the file frees the lock


def _flock_within(fd: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the metrics files' lock was held over {wait_s} s") from None
            time.sleep(0.01)


def _read(path: Path) -> Families:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    if len(raw) > MAX_BYTES:
        log.warning("metrics: %s is over %d bytes; left out", path, MAX_BYTES)
        return {}
    try:
        return loads(raw)
    except (ValueError, TypeError) as e:
        log.warning("metrics: %s is not of its shape (%s); left out", path, e)
        return {}


def _write(path: Path, fams: Families) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(dumps(fams))
    tmp.replace(path)  # whole or not at all, for a reader that takes no lock


def _pid(path: Path) -> int | None:
    return int(path.stem) if path.stem.isdigit() else None


def settle(folder: Path, fresh: dict[int, Families], me: int | None = None) -> Families:
    """Record what was just read of each worker (``fresh``, by pid) and return
    the counters and histograms of every worker not in it: alive but silent,
    or dead and not yet retired (their ``.last``), and of the retired. A sibling
    whose socket went since it answered leaves ``fresh``: it is ending, and
    only what is recorded (its ``.last``, then ``retired.json``) may count it,
    else this scrape shows counts the next ones cannot (``me``: the caller)."""
    out: Families = {}
    with _locked(folder, wait_s=SIBLING_TIMEOUT_S):
        for pid in [p for p in fresh if p != me and not socket_path(folder, p).exists()]:
            del fresh[pid]
        for pid, fams in list(fresh.items()):
            if not socket_path(folder, pid).exists():
                continue  # the caller, ending: retired (or soon) from its .last
            last = folder / f"{pid}.last"
            try:
                _write(last, _highest(_read(last), fams))
            except OSError as e:  # the disk full, say: shown, it could not be shown again
                log.warning("metrics: the counts of worker %d not recorded: %s", pid, e)
                if pid != me:
                    del fresh[pid]  # counted by what is recorded of it instead
        for last in folder.glob("*.last"):
            if _pid(last) not in fresh:
                add(out, _read(last), monotonic_only=True)
        add(out, _read(folder / "retired.json"), monotonic_only=True)
    return out


def retire(folder: Path, pid: int) -> None:
    """Worker ``pid`` has ended: keep the counts last exposed of it for good.
    (The supervisor's, after waitpid.)"""
    socket_path(folder, pid).unlink(missing_ok=True)  # no scrape records it again after this
    with _locked(folder):
        last = folder / f"{pid}.last"
        gone = _read(last)
        if gone:
            retired = _read(folder / "retired.json")
            add(retired, gone, monotonic_only=True)
            _write(folder / "retired.json", retired)
        last.unlink(missing_ok=True)


# -- sockets: a worker answers its samples; a scrape asks every sibling ------
def socket_path(folder: Path, pid: int) -> Path:
    return folder / f"{pid}.sock"


async def read_sibling(path: Path, timeout_s: float = SIBLING_TIMEOUT_S) -> Families | None:
    """One sibling's families, or None (with a warning) if it does not send them
    whole within ``timeout_s`` and ``MAX_BYTES``."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(str(path))
            chunks, size = [], 0
            while chunk := await reader.read(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BYTES:
                    log.warning(
                        "metrics: worker %s sent over %d bytes; skipped", path.stem, MAX_BYTES
                    )
                    return None
        return loads(b"".join(chunks))
    except (FileNotFoundError, ConnectionRefusedError):
        return None  # it ended between the listing and the call: the supervisor retires it
    except TimeoutError:
        log.warning("metrics: worker %s did not answer in %.1f s; skipped", path.stem, timeout_s)
    except (OSError, ValueError, TypeError) as e:
        log.warning("metrics: worker %s: %s; skipped", path.stem, e)
    finally:
        if writer is not None:
            writer.close()
    return None


def siblings(folder: Path, me: int) -> list[tuple[int, Path]]:
    return [(pid, p) for p in folder.glob("*.sock") if (pid := _pid(p)) is not None and pid != me]


async def serve(path: Path, answer: Callable[[], bytes]) -> None:
    """Answer ``answer()`` (this worker's families, dumped) to each connection
    on ``path`` until cancelled; the socket file goes with the server."""

    async def one(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(answer())
            async with asyncio.timeout(SIBLING_TIMEOUT_S):  # a scrape that stopped reading
                await writer.drain()
        except (OSError, TimeoutError):
            pass  # the asking worker gave up on us: its warning says so
        finally:
            writer.close()

    # Unlinking a socket file is one quick system call, not I/O to wait on.
    path.unlink(missing_ok=True)  # noqa: ASYNC240 (left by an earlier process of this pid)
    server = await asyncio.start_unix_server(one, str(path))
    try:
        await asyncio.Event().wait()
    finally:
        server.close()
        path.unlink(missing_ok=True)  # noqa: ASYNC240
