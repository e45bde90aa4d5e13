/* The per-read event path of a stream, compiled.
 *
 * The same semantics as proxy/dataplane/sse.py (SSEParser.feed and
 * SSEParser.relay, the reference): the SSE split of a rank's bytes, and, for
 * the common chunk of a stream (one token, neither the first nor the last),
 * the token bookkeeping on bytes and the client's bytes for the whole read.
 * The book's state stays with Python: relay() returns what to add to it and
 * the events, in order, that Python must handle itself.
 *
 * Stream: a pump's data callback (proxy/dataplane/hold/pump.py, whose Python
 * path is its reference) that takes a read made only of common chunks
 * without a Python frame: relayed, counted into the book, its time stamped
 * (heard_at), written to the client as one HTTP chunk.
 *
 * And one check of a whole (non-streamed) answer: is_object(), whether its
 * body is a JSON object as orjson reads one (the reference:
 * proxy.dataplane.generation), without building it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

/* time.monotonic()'s clock (macOS: mach_absolute_time, which stops in sleep). */
#ifdef __APPLE__
#define MONOTONIC_CLOCK CLOCK_UPTIME_RAW
#else
#define MONOTONIC_CLOCK CLOCK_MONOTONIC
#endif

/* The error for an unfinished event over max_event bytes: sse.EventTooLarge
 * once bind() has run (ValueError before, its base class). */
static PyObject *too_large = NULL;
static Py_ssize_t max_event = (Py_ssize_t)8 << 20;

/* A growable byte buffer: the client's bytes of one read, or an unfinished event. */
#define OUT_KEPT ((Py_ssize_t)64 << 10) /* a Stream's, kept from read to read up to this */
typedef struct {
    char *p;
    Py_ssize_t len;
    Py_ssize_t cap;
} Out;

typedef struct {
    PyObject_HEAD
    Out pending;      /* the unfinished event's parts, joined as they come */
    Py_ssize_t size;  /* SSEParser._size: counted even for a part refused */
    Py_ssize_t parts; /* parts kept: SSEParser's `not self._parts` */
} Parser;

/* -- bytes ---------------------------------------------------------------- */

static Py_ssize_t
find(const char *h, Py_ssize_t hn, const char *nd, Py_ssize_t nn, Py_ssize_t from)
{
    const char *p = h + from, *end = h + hn;
    while (end - p >= nn) {
        p = memchr(p, nd[0], (size_t)((end - p) - nn + 1));
        if (p == NULL)
            return -1;
        if (memcmp(p, nd, (size_t)nn) == 0)
            return p - h;
        p++;
    }
    return -1;
}

#define FIND(h, n, lit, from) find((h), (n), (lit), (Py_ssize_t)(sizeof(lit) - 1), (from))

/* An event's end: "\n\n" or "\r\n\r\n" (sse._has_end). */
static int
has_end(const char *p, Py_ssize_t n)
{
    const char *end = p + n, *q = p;
    while ((q = memchr(q, '\n', (size_t)(end - q))) != NULL) {
        if (q + 1 < end && q[1] == '\n')
            return 1;
        if (q > p && q[-1] == '\r' && q + 2 < end && q[1] == '\r' && q[2] == '\n')
            return 1;
        q++;
    }
    return 0;
}

static int
out_put(Out *o, const char *d, Py_ssize_t n)
{
    if (n == 0)
        return 0; /* memcpy into a buffer not yet allocated (NULL) is undefined, even of nothing */
    if (o->len + n > o->cap) {
        Py_ssize_t cap = o->cap ? o->cap : 256;
        while (cap < o->len + n)
            cap *= 2;
        char *p = PyMem_Realloc(o->p, (size_t)cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->p = p;
        o->cap = cap;
    }
    memcpy(o->p + o->len, d, (size_t)n);
    o->len += n;
    return 0;
}

/* -- the SSE split (SSEParser.feed) ---------------------------------------- */

/* Append to the unfinished event's bytes (a join: no bound checked). */
static int
put(Parser *self, const char *d, Py_ssize_t n)
{
    return out_put(&self->pending, d, n);
}

/* SSEParser._keep: memory stays bounded while an event's end is awaited. */
static int
keep(Parser *self, const char *d, Py_ssize_t n)
{
    self->size += n;
    if (self->size > max_event) {
        PyErr_Format(too_large ? too_large : PyExc_ValueError,
                     "an event of over %zd MiB without an end", max_event >> 20);
        return -1;
    }
    if (put(self, d, n) < 0)
        return -1;
    self->parts++;
    return 0;
}

/* One event's data: its "data:" lines, leading spaces off, joined with
 * newlines; none: nothing appended. */
static int
add_event(PyObject *events, const char *e, Py_ssize_t n)
{
    Py_ssize_t total = 0, lines = 0, i = 0;
    for (int pass = 0; pass < 2; pass++) {
        char *w = NULL;
        PyObject *data = NULL;
        if (pass == 1) {
            if (lines == 0)
                return 0;
            data = PyBytes_FromStringAndSize(NULL, total + lines - 1);
            if (data == NULL)
                return -1;
            w = PyBytes_AS_STRING(data);
        }
        Py_ssize_t seen = 0;
        for (i = 0; i <= n;) {
            const char *nl = memchr(e + i, '\n', (size_t)(n - i));
            Py_ssize_t stop = nl ? nl - e : n;
            if (stop - i >= 5 && memcmp(e + i, "data:", 5) == 0) {
                Py_ssize_t v = i + 5;
                while (v < stop && e[v] == ' ')
                    v++;
                if (pass == 0) {
                    total += stop - v;
                    lines++;
                } else {
                    if (seen++)
                        *w++ = '\n';
                    memcpy(w, e + v, (size_t)(stop - v));
                    w += stop - v;
                }
            }
            i = stop + 1;
        }
        if (pass == 1) {
            int r = PyList_Append(events, data);
            Py_DECREF(data);
            return r;
        }
    }
    return 0;
}

/* Split bytes holding an event's end into events; the rest is kept. */
static int
parse(Parser *self, PyObject *events, const char *p, Py_ssize_t n)
{
    char *fixed = NULL;
    if (FIND(p, n, "\r\n", 0) >= 0) { /* CRLF lines: as LF ones (bytes.replace) */
        fixed = PyMem_Malloc((size_t)(n ? n : 1));
        if (fixed == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t w = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (p[i] == '\r' && i + 1 < n && p[i + 1] == '\n')
                continue;
            fixed[w++] = p[i];
        }
        p = fixed;
        n = w;
    }
    Py_ssize_t start = 0, at;
    int r = 0;
    while ((at = FIND(p, n, "\n\n", start)) >= 0) {
        if (add_event(events, p + start, at - start) < 0) {
            r = -1;
            break;
        }
        start = at + 2;
    }
    if (r == 0) {
        if (n - start > 0)
            r = keep(self, p + start, n - start);
    }
    PyMem_Free(fixed);
    return r;
}

static Py_ssize_t
count_nl(const char *p, Py_ssize_t n)
{
    Py_ssize_t c = 0;
    const char *end = p + n;
    while ((p = memchr(p, '\n', (size_t)(end - p))) != NULL) {
        c++;
        p++;
    }
    return c;
}

static PyObject *
split(Parser *self, PyObject *chunk)
{
    const char *c = PyBytes_AS_STRING(chunk);
    Py_ssize_t n = PyBytes_GET_SIZE(chunk);
    PyObject *events = PyList_New(0);
    if (events == NULL)
        return NULL;
    if (self->parts == 0) {
        /* The common case: exactly one whole single-line event. */
        if (n >= 8 && memcmp(c, "data: ", 6) == 0 && c[n - 2] == '\n' && c[n - 1] == '\n'
            && count_nl(c, n) == 2) {
            PyObject *data = PyBytes_FromStringAndSize(c + 6, n - 8);
            if (data == NULL || PyList_Append(events, data) < 0) {
                Py_XDECREF(data);
                Py_DECREF(events);
                return NULL;
            }
            Py_DECREF(data);
            return events;
        }
        int r = has_end(c, n) ? parse(self, events, c, n) : keep(self, c, n);
        if (r < 0) {
            Py_CLEAR(events);
        }
        return events;
    }
    /* An event's end split across two reads: in the kept tail and this head. */
    char probe[6];
    Py_ssize_t t = self->pending.len < 3 ? self->pending.len : 3, h = n < 3 ? n : 3;
    if (t > 0) /* parts kept may all be empty: no buffer yet (NULL) */
        memcpy(probe, self->pending.p + self->pending.len - t, (size_t)t);
    memcpy(probe + t, c, (size_t)h);
    if (!has_end(probe, t + h) && !has_end(c, n)) {
        if (keep(self, c, n) < 0)
            Py_CLEAR(events);
        return events;
    }
    if (put(self, c, n) < 0) { /* joined with the parts before it */
        Py_DECREF(events);
        return NULL;
    }
    char *joined = self->pending.p;
    Py_ssize_t jn = self->pending.len;
    self->pending.p = NULL;
    self->pending.len = self->pending.cap = self->size = self->parts = 0;
    int r = has_end(joined, jn) ? parse(self, events, joined, jn) : keep(self, joined, jn);
    PyMem_Free(joined);
    if (r < 0)
        Py_CLEAR(events);
    return events;
}

/* -- the common chunk on bytes (sse.take_chunk) ----------------------------- */

/* Token ids: plain decimal digits, comma-separated, or none. -1: anything
 * else (Python parses the chunk), a number of more than MAX_ID_DIGITS too
 * (no vocabulary is that large; JSON's parser judges it, as sse._ids says). */
#define MAX_ID_DIGITS 18
static Py_ssize_t
check_ids(const char *p, Py_ssize_t n)
{
    Py_ssize_t ids = 0, digits = 0;
    if (n == 0)
        return 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i == n || p[i] == ',') {
            if (digits == 0)
                return -1;
            ids++;
            digits = 0;
        } else if (p[i] >= '0' && p[i] <= '9') {
            if (++digits > MAX_ID_DIGITS)
                return -1;
        } else {
            return -1;
        }
    }
    return ids;
}

/* One of check_ids' numbers: at most MAX_ID_DIGITS digits, so a long long. */
static PyObject *
parse_id(const char *p, Py_ssize_t n)
{
    long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        v = v * 10 + (p[i] - '0');
    return PyLong_FromLongLong(v);
}

/* What take() looks for in a chunk, found in one pass: every pattern begins
 * with a quote, so looking at each quote finds every occurrence (none of
 * them overlaps itself, so counting there is bytes.count). */
typedef struct {
    Py_ssize_t finish_nulls; /* "finish_reason":null */
    int prompt_ids;          /* "prompt_token_ids":[ */
    int index0;              /* "index":0 */
    Py_ssize_t ids;          /* the first "token_ids":[, or -1 */
    int empty;               /* "text":"" or "content":"" */
} Scan;

#define AT(q, lit) \
    (end - (q) >= (Py_ssize_t)(sizeof(lit) - 1) && memcmp((q), (lit), sizeof(lit) - 1) == 0)

static void
scan(const char *d, Py_ssize_t n, Scan *s)
{
    const char *q = d, *end = d + n;
    *s = (Scan){0, 0, 0, -1, 0};
    while ((q = memchr(q, '"', (size_t)(end - q))) != NULL) {
        switch (end - q > 1 ? q[1] : 0) {
        case 'f':
            s->finish_nulls += AT(q, "\"finish_reason\":null");
            break;
        case 'p':
            s->prompt_ids |= AT(q, "\"prompt_token_ids\":[");
            break;
        case 'i':
            s->index0 |= AT(q, "\"index\":0");
            break;
        case 't':
            if (s->ids < 0 && AT(q, "\"token_ids\":["))
                s->ids = q - d;
            else
                s->empty |= AT(q, "\"text\":\"\"");
            break;
        case 'c':
            s->empty |= AT(q, "\"content\":\"\"");
            break;
        }
        q++;
    }
}

/* One event taken on bytes: 1, its client bytes written to `out` and its ids
 * appended to `ids`; 0: not the common chunk (nothing written). */
static int
take(PyObject *event, int wants_ids, Out *out, PyObject *ids, Py_ssize_t *got,
     int *empty)
{
    const char *d = PyBytes_AS_STRING(event);
    Py_ssize_t n = PyBytes_GET_SIZE(event);
    Scan s;
    scan(d, n, &s);
    if (s.finish_nulls != 1 || s.prompt_ids || !s.index0 || s.ids < 0)
        return 0;
    /* One line only (sse.common_chunk): data of several is written a field a
     * line (sse.event), not as "data: " and its bytes. */
    if (memchr(d, '\n', (size_t)n) != NULL || memchr(d, '\r', (size_t)n) != NULL)
        return 0;
    Py_ssize_t start = s.ids;
    Py_ssize_t end = FIND(d, n, "]", start);
    if (end < 0)
        return 0;
    const char *inner = d + start + 13;
    Py_ssize_t inner_n = end - start - 13, count = check_ids(inner, inner_n);
    if (count < 0)
        return 0;
    Py_ssize_t i = 0;
    while (i < inner_n) {
        Py_ssize_t j = i;
        while (j < inner_n && inner[j] != ',')
            j++;
        PyObject *v = parse_id(inner + i, j - i);
        if (v == NULL || PyList_Append(ids, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
        i = j + 1;
    }
    *got = count;
    *empty = s.empty;
    if (out_put(out, "data: ", 6) < 0)
        return -1;
    if (wants_ids) {
        if (out_put(out, d, n) < 0)
            return -1;
    } else if (out_put(out, d, start) < 0 || out_put(out, "\"token_ids\":null", 16) < 0
               || out_put(out, d + end + 1, n - end - 1) < 0) {
        return -1;
    }
    return out_put(out, "\n\n", 2) < 0 ? -1 : 1;
}

/* -- the type ----------------------------------------------------------------- */

static PyObject *
Parser_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Parser() takes no arguments");
        return NULL;
    }
    Parser *self = (Parser *)type->tp_alloc(type, 0);
    return (PyObject *)self; /* tp_alloc zeroes: no parts */
}

static void
Parser_dealloc(Parser *self)
{
    PyMem_Free(self->pending.p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Parser_feed(Parser *self, PyObject *chunk)
{
    if (!PyBytes_Check(chunk)) {
        PyErr_Format(PyExc_TypeError, "feed() takes bytes, not %.100s", Py_TYPE(chunk)->tp_name);
        return NULL;
    }
    return split(self, chunk);
}

/* relay()'s work on one read, into lists and a buffer the caller gives:
 * the ids, records and suspects of the common chunks it took, the client's
 * bytes for them in `out`; returns the read's events (a new reference, or
 * NULL on an error), of which the first *taken were taken. */
static PyObject *
relay_into(Parser *self, PyObject *chunk, Py_ssize_t k, int wants_ids, Out *out, PyObject *ids,
           PyObject *records, PyObject *suspects, Py_ssize_t *taken)
{
    PyObject *events = split(self, chunk);
    if (events == NULL)
        return NULL;
    Py_ssize_t i, n = PyList_GET_SIZE(events);
    for (i = 0; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        Py_ssize_t got = 0;
        int empty = 0, r = take(event, wants_ids, out, ids, &got, &empty);
        if (r < 0)
            goto fail;
        if (r == 0)
            break;
        k += got;
        PyObject *at = PyLong_FromSsize_t(k);
        PyObject *record = at ? PyTuple_Pack(2, at, event) : NULL;
        Py_XDECREF(at);
        if (record == NULL || PyList_Append(records, record) < 0) {
            Py_XDECREF(record);
            goto fail;
        }
        Py_DECREF(record);
        if (got == 1 && empty
            && PyList_Append(suspects, PyList_GET_ITEM(ids, PyList_GET_SIZE(ids) - 1)) < 0)
            goto fail;
    }
    *taken = i;
    return events;
fail:
    Py_DECREF(events);
    return NULL;
}

/* What relay() returns: (client bytes, ids, records, suspects, events left). */
static PyObject *
relayed_tuple(const Out *out, PyObject *ids, PyObject *records, PyObject *suspects,
              PyObject *events, Py_ssize_t taken)
{
    PyObject *rest = PyList_GetSlice(events, taken, PyList_GET_SIZE(events));
    PyObject *client = PyBytes_FromStringAndSize(out->p ? out->p : "", out->len);
    PyObject *result = NULL;
    if (rest != NULL && client != NULL)
        result = PyTuple_Pack(5, client, ids, records, suspects, rest);
    Py_XDECREF(client);
    Py_XDECREF(rest);
    return result;
}

/* SSEParser.relay: (client bytes, ids, records, suspects, events left). */
static PyObject *
relay(Parser *self, PyObject *chunk, Py_ssize_t k, int wants_ids)
{
    PyObject *ids = PyList_New(0), *records = PyList_New(0), *suspects = PyList_New(0);
    PyObject *events = NULL, *result = NULL;
    Out out = {NULL, 0, 0};
    Py_ssize_t taken = 0;
    if (ids != NULL && records != NULL && suspects != NULL)
        events = relay_into(self, chunk, k, wants_ids, &out, ids, records, suspects, &taken);
    if (events != NULL)
        result = relayed_tuple(&out, ids, records, suspects, events, taken);
    PyMem_Free(out.p);
    Py_XDECREF(ids);
    Py_XDECREF(records);
    Py_XDECREF(suspects);
    Py_XDECREF(events);
    return result;
}

static PyObject *
Parser_relay(Parser *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "relay(chunk: bytes, base: int, wants_ids: bool)");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    int wants_ids = PyObject_IsTrue(args[2]);
    if ((k == -1 && PyErr_Occurred()) || wants_ids < 0)
        return NULL;
    return relay(self, args[0], k, wants_ids);
}

static PyMethodDef Parser_methods[] = {
    {"feed", (PyCFunction)Parser_feed, METH_O, "Raw bytes in; each complete event's data out."},
    {"relay", (PyCFunction)(void (*)(void))Parser_relay, METH_FASTCALL,
     "One read: (client bytes, ids, records, suspects, events left to Python)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ParserType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.dataplane._events.Parser",
    .tp_basicsize = sizeof(Parser),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SSEParser, compiled: the same feed() and relay().",
    .tp_new = Parser_new,
    .tp_dealloc = (destructor)Parser_dealloc,
    .tp_methods = Parser_methods,
};

/* -- a stream's common reads, relayed (proxy.dataplane.hold.pump) ------------ */

/* Stream(parser, book, transport, chunked, run, slow, rest,
 * armable, high_water, slack): what a Pump's data callback does with a read of the
 * original stream, with no Python frame for the common read: one whose
 * events are all common chunks (SSEParser.relay), while the book may take
 * them on bytes and no hold is on. Their ids and records go into the book
 * (Book.counted), the read's time into `heard_at` (time.monotonic()'s clock:
 * the Flow and the rank's liveness read it when they judge silence, where
 * Python's reads call Flow.heard), their bytes go to the client as one HTTP
 * chunk (ChunkSink.write_now). Any other read goes to
 * Python, through `run` (the request's context): the whole read to `slow`,
 * or, once relayed, the relay's result to `rest`, before anything is
 * changed. After each of Python's turns `armable()` says whether the next
 * read may be taken here (`armed`: Book.bytes_ok, the first byte out, no
 * hold on; Hold.start clears it too, and a liveness that ejects the rank);
 * `drain` says a write found the client's buffer past `high_water`. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Parser *parser;
    PyObject *book, *transport, *run, *slow, *rest, *armable;
    /* The client's transport once known, and its methods a read calls (a
     * connection's transport is never replaced: a gone client's says it is
     * closing). */
    PyObject *client, *is_closing, *write, *buffer_size;
    /* One read's common chunks (relay_into), kept from read to read: */
    PyObject *ids, *records, *suspects;
    Out out; /* their bytes for the client */
    int chunked, wants_ids;
    char armed, drain; /* T_BOOL members */
    double heard_at;
    Py_ssize_t high_water, slack;
} Stream;

static PyObject *s_generated, *s_records, *s_cap, *s_is_closing, *s_write, *s_buffer_size;

static int
Stream_traverse(Stream *self, visitproc visit, void *arg)
{
    Py_VISIT(self->parser);
    Py_VISIT(self->book);
    Py_VISIT(self->transport);
    Py_VISIT(self->run);
    Py_VISIT(self->slow);
    Py_VISIT(self->rest);
    Py_VISIT(self->armable);
    Py_VISIT(self->client);
    Py_VISIT(self->is_closing);
    Py_VISIT(self->write);
    Py_VISIT(self->buffer_size);
    Py_VISIT(self->ids);
    Py_VISIT(self->records);
    Py_VISIT(self->suspects);
    return 0;
}

static int
Stream_clear(Stream *self)
{
    Py_CLEAR(self->parser);
    Py_CLEAR(self->book);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->run);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->rest);
    Py_CLEAR(self->armable);
    Py_CLEAR(self->client);
    Py_CLEAR(self->is_closing);
    Py_CLEAR(self->write);
    Py_CLEAR(self->buffer_size);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->records);
    Py_CLEAR(self->suspects);
    return 0;
}

static void
Stream_dealloc(Stream *self)
{
    PyObject_GC_UnTrack(self);
    Stream_clear(self);
    PyMem_Free(self->out.p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Stream_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames);

static PyObject *
Stream_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *parser, *book, *transport, *run, *slow, *rest, *armable;
    int chunked;
    Py_ssize_t high_water, slack;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Stream() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OOpOOOOnn:Stream", &ParserType, &parser, &book, &transport,
                          &chunked, &run, &slow, &rest, &armable, &high_water, &slack))
        return NULL;
    PyObject *wants = PyObject_GetAttrString(book, "wants_ids");
    int wants_ids = wants ? PyObject_IsTrue(wants) : -1;
    Py_XDECREF(wants);
    if (wants_ids < 0)
        return NULL;
    Stream *self = (Stream *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = Stream_call;
    self->parser = (Parser *)Py_NewRef(parser);
    self->book = Py_NewRef(book);
    self->transport = Py_NewRef(transport);
    self->run = Py_NewRef(run);
    self->slow = Py_NewRef(slow);
    self->rest = Py_NewRef(rest);
    self->armable = Py_NewRef(armable);
    self->chunked = chunked;
    self->wants_ids = wants_ids;
    self->high_water = high_water;
    self->slack = slack;
    self->ids = PyList_New(0);
    self->records = PyList_New(0);
    self->suspects = PyList_New(0);
    if (self->ids == NULL || self->records == NULL || self->suspects == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* run(fn, arg): Python's turn, in the request's context. */
static PyObject *
in_context(Stream *self, PyObject *fn, PyObject *arg)
{
    PyObject *argv[2] = {fn, arg};
    return PyObject_Vectorcall(self->run, argv, arg ? 2 : 1, NULL);
}

/* A read handed to Python (`slow` or `rest`), then whether the next may be
 * taken here. */
static PyObject *
python_turn(Stream *self, PyObject *fn, PyObject *arg)
{
    PyObject *result = in_context(self, fn, arg);
    if (result == NULL)
        return NULL;
    PyObject *armed = PyObject_CallNoArgs(self->armable);
    int yes = armed ? PyObject_IsTrue(armed) : -1;
    Py_XDECREF(armed);
    if (yes < 0) {
        Py_DECREF(result);
        return NULL;
    }
    self->armed = (char)yes;
    return result;
}

/* The client's transport and its methods, fetched once: 1, or 0 while
 * there is none (the connection is gone), -1 an error. */
static int
known_client(Stream *self)
{
    if (self->client != NULL)
        return 1;
    PyObject *transport = PyObject_CallNoArgs(self->transport);
    if (transport == NULL)
        return -1;
    if (transport == Py_None) {
        Py_DECREF(transport);
        return 0;
    }
    PyObject *closing = PyObject_GetAttr(transport, s_is_closing);
    PyObject *write = closing ? PyObject_GetAttr(transport, s_write) : NULL;
    PyObject *size = write ? PyObject_GetAttr(transport, s_buffer_size) : NULL;
    if (size == NULL) {
        Py_DECREF(transport);
        Py_XDECREF(closing);
        Py_XDECREF(write);
        return -1;
    }
    self->client = transport;
    self->is_closing = closing;
    self->write = write;
    self->buffer_size = size;
    return 1;
}

/* Whether the client can take bytes: 1, 0 where it cannot (closed,
 * closing, gone), -1 an error. */
static int
writable(Stream *self)
{
    int known = known_client(self);
    if (known <= 0)
        return known;
    PyObject *closing = PyObject_CallNoArgs(self->is_closing);
    int yes = closing ? PyObject_IsTrue(closing) : -1;
    Py_XDECREF(closing);
    return yes < 0 ? -1 : !yes;
}

/* The ids and records into the book's lists, if within its room
 * (Book._room): 1 taken, 0 no room (nothing changed), -1 an error. */
static int
count(Stream *self, PyObject *generated, PyObject *ids, PyObject *records)
{
    int r = -1;
    PyObject *kept = PyObject_GetAttr(self->book, s_records);
    PyObject *capo = PyObject_GetAttr(self->book, s_cap);
    if (kept == NULL || capo == NULL)
        goto done;
    if (!PyList_Check(kept)) {
        PyErr_SetString(PyExc_TypeError, "the book's records must be a list");
        goto done;
    }
    /* The cap is the client's (max_tokens x n x prompts): any int. Past a
     * machine word it is room enough (below zero, none: Python refuses);
     * the records' bound, 2 * cap + slack, saturates rather than overflows. */
    int past = 0;
    long long cap = PyLong_AsLongLongAndOverflow(capo, &past);
    if (cap == -1 && PyErr_Occurred())
        goto done;
    if (past > 0)
        cap = LLONG_MAX;
    if (past < 0 || cap < 0) {
        r = 0;
        goto done;
    }
    long long most = cap > (LLONG_MAX - self->slack) / 2 ? LLONG_MAX : 2 * cap + self->slack;
    long long g = PyList_GET_SIZE(generated), k = PyList_GET_SIZE(kept);
    if (g + PyList_GET_SIZE(ids) > cap || k + PyList_GET_SIZE(records) > most) {
        r = 0;
        goto done;
    }
    r = (PyList_SetSlice(generated, g, g, ids) < 0 || PyList_SetSlice(kept, k, k, records) < 0)
            ? -1
            : 1;
done:
    Py_XDECREF(kept);
    Py_XDECREF(capo);
    return r;
}

/* "%zx\r\n" of n into buf (at least 19 bytes): its length. (snprintf
 * cost a tenth of a stream's compiled read.) */
static int
hex_line(char *buf, Py_ssize_t n)
{
    static const char digits[] = "0123456789abcdef";
    char tmp[16];
    int k = 0;
    size_t v = (size_t)n;
    do {
        tmp[k++] = digits[v & 15];
        v >>= 4;
    } while (v != 0);
    for (int i = 0; i < k; i++)
        buf[i] = tmp[k - 1 - i];
    buf[k] = '\r';
    buf[k + 1] = '\n';
    return k + 2;
}

/* The client's bytes of one read (`out`), as one HTTP chunk (or as they
 * are, for an HTTP/1.0 client); 1: the client is reading, 0: drain first. */
static int
send_out(Stream *self)
{
    Py_ssize_t n = self->out.len;
    PyObject *data;
    if (self->chunked) {
        char size[20];
        int sn = hex_line(size, n);
        data = PyBytes_FromStringAndSize(NULL, sn + n + 2);
        if (data == NULL)
            return -1;
        char *w = PyBytes_AS_STRING(data);
        memcpy(w, size, (size_t)sn);
        memcpy(w + sn, self->out.p, (size_t)n);
        memcpy(w + sn + n, "\r\n", 2);
    } else {
        data = PyBytes_FromStringAndSize(self->out.p, n);
        if (data == NULL)
            return -1;
    }
    PyObject *done = PyObject_CallOneArg(self->write, data);
    Py_DECREF(data);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    PyObject *size = PyObject_CallNoArgs(self->buffer_size);
    if (size == NULL)
        return -1;
    Py_ssize_t buffered = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (buffered == -1 && PyErr_Occurred())
        return -1;
    return buffered <= self->high_water;
}

/* The read, relayed, to Python (`rest`): what relay() returns, its lists
 * copies of the scratch ones, which the next read empties. */
static PyObject *
to_python(Stream *self, PyObject *events, Py_ssize_t taken)
{
    PyObject *ids = PyList_GetSlice(self->ids, 0, PY_SSIZE_T_MAX);
    PyObject *records = ids ? PyList_GetSlice(self->records, 0, PY_SSIZE_T_MAX) : NULL;
    PyObject *suspects = records ? PyList_GetSlice(self->suspects, 0, PY_SSIZE_T_MAX) : NULL;
    PyObject *relayed = NULL, *result = NULL;
    if (suspects != NULL)
        relayed = relayed_tuple(&self->out, ids, records, suspects, events, taken);
    if (relayed != NULL)
        result = python_turn(self, self->rest, relayed);
    Py_XDECREF(ids);
    Py_XDECREF(records);
    Py_XDECREF(suspects);
    Py_XDECREF(relayed);
    return result;
}

static PyObject *
Stream_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Stream *self = (Stream *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "a Stream takes one read (bytes)");
        return NULL;
    }
    PyObject *chunk = args[0];
    if (!self->armed) /* a hold on (Hold.start disarms it), a full book, ... */
        return python_turn(self, self->slow, chunk);
    PyObject *generated = PyObject_GetAttr(self->book, s_generated);
    if (generated == NULL)
        return NULL;
    if (!PyList_Check(generated)) {
        Py_DECREF(generated);
        PyErr_SetString(PyExc_TypeError, "the book's generated must be a list");
        return NULL;
    }
    Py_ssize_t base = PyList_GET_SIZE(generated);
    /* The scratch lists emptied (a list slice assignment keeps its room). */
    if (PyList_SetSlice(self->ids, 0, PY_SSIZE_T_MAX, NULL) < 0
        || PyList_SetSlice(self->records, 0, PY_SSIZE_T_MAX, NULL) < 0
        || PyList_SetSlice(self->suspects, 0, PY_SSIZE_T_MAX, NULL) < 0) {
        Py_DECREF(generated);
        return NULL;
    }
    self->out.len = 0;
    Py_ssize_t taken = 0;
    PyObject *events = relay_into(self->parser, chunk, base, self->wants_ids, &self->out,
                                  self->ids, self->records, self->suspects, &taken);
    PyObject *result = NULL;
    int can_write = 0;
    if (events == NULL)
        goto done;
    if (PyList_GET_SIZE(events) == 0) {
        result = Py_NewRef(Py_True); /* no event ended in this read */
        goto done;
    }
    /* Events Python handles, a token that came alone without text (a
     * suspect), a client that cannot take bytes: Python's, untouched. */
    if (taken < PyList_GET_SIZE(events) || PyList_GET_SIZE(self->suspects) > 0
        || (can_write = writable(self)) <= 0) {
        if (can_write < 0)
            goto done;
        result = to_python(self, events, taken);
        goto done;
    }
    int counted = count(self, generated, self->ids, self->records);
    if (counted < 0)
        goto done;
    if (counted == 0) { /* past the book's room: Python refuses it (Overrun) */
        result = to_python(self, events, taken);
        goto done;
    }
    struct timespec now;
    clock_gettime(MONOTONIC_CLOCK, &now);
    self->heard_at = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
    int reading = send_out(self);
    if (reading < 0)
        goto done;
    if (!reading)
        self->drain = 1;
    result = Py_NewRef(reading ? Py_True : Py_False);
done:
    Py_DECREF(generated);
    Py_XDECREF(events);
    if (self->out.cap > OUT_KEPT) { /* a large read's buffer is not kept */
        PyMem_Free(self->out.p);
        self->out.p = NULL;
        self->out.len = self->out.cap = 0;
    }
    return result;
}

static PyMemberDef Stream_members[] = {
    {"armed", T_BOOL, offsetof(Stream, armed), 0,
     "Common reads are taken here (Python clears it while the book may not)."},
    {"drain", T_BOOL, offsetof(Stream, drain), 0,
     "A write found the client not reading: wait for it before the next."},
    {"heard_at", T_DOUBLE, offsetof(Stream, heard_at), READONLY,
     "time.monotonic() of the last read relayed here (0.0 before any)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.dataplane._events.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A pump's data callback for the original stream, its common reads compiled.",
    .tp_new = Stream_new,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_traverse = (traverseproc)Stream_traverse,
    .tp_clear = (inquiry)Stream_clear,
    .tp_vectorcall_offset = offsetof(Stream, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_members = Stream_members,
};

static PyObject *
bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyExceptionClass_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind(error: type[Exception], max_event: int)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    Py_INCREF(args[0]);
    Py_XSETREF(too_large, args[0]);
    max_event = limit;
    Py_RETURN_NONE;
}

/* -- a whole answer's body -------------------------------------------------- */

/* is_object(raw): True exactly where isinstance(orjson.loads(raw), dict)
 * (tests/test_answer_object.py compares the two): RFC 8259 JSON, strict
 * UTF-8 in strings (no surrogates, no overlong forms), paired \u surrogates,
 * at most 1024 nested containers, no number that is infinite as a double,
 * and an object at the top, with only whitespace around it. */

#define MAX_DEPTH 1024

static const unsigned char *
skip_ws(const unsigned char *p, const unsigned char *end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

static int
hex4(const unsigned char *p, const unsigned char *end, unsigned *u)
{
    if (end - p < 4)
        return 0;
    *u = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f')
            d = (c | 0x20) - 'a' + 10;
        else
            return 0;
        *u = *u << 4 | d;
    }
    return 1;
}

/* After a backslash: the end of its escape, or NULL. */
static const unsigned char *
scan_escape(const unsigned char *p, const unsigned char *end)
{
    unsigned u, low;
    if (p >= end)
        return NULL;
    switch (*p) {
    case '"':
    case '\\':
    case '/':
    case 'b':
    case 'f':
    case 'n':
    case 'r':
    case 't':
        return p + 1;
    }
    if (*p != 'u' || !hex4(p + 1, end, &u))
        return NULL;
    p += 5;
    if (u >= 0xDC00 && u <= 0xDFFF)
        return NULL; /* a low surrogate alone */
    if (u >= 0xD800 && u <= 0xDBFF) {
        if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || !hex4(p + 2, end, &low)
            || low < 0xDC00 || low > 0xDFFF)
            return NULL; /* a high surrogate without its low one */
        p += 6;
    }
    return p;
}

static int
cont(const unsigned char *p, const unsigned char *end, Py_ssize_t n)
{
    if (end - p < n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    return 1;
}

/* One UTF-8 character of two to four bytes: its end, or NULL. */
static const unsigned char *
scan_utf8(const unsigned char *p, const unsigned char *end)
{
    unsigned c = p[0], next = end - p > 1 ? p[1] : 0;
    if (c >= 0xC2 && c <= 0xDF)
        return cont(p + 1, end, 1) ? p + 2 : NULL;
    if (c == 0xE0 && (next < 0xA0 || next > 0xBF))
        return NULL; /* overlong */
    if (c == 0xED && (next < 0x80 || next > 0x9F))
        return NULL; /* a surrogate */
    if (c >= 0xE0 && c <= 0xEF)
        return cont(p + 1, end, 2) ? p + 3 : NULL;
    if (c == 0xF0 && (next < 0x90 || next > 0xBF))
        return NULL; /* overlong */
    if (c == 0xF4 && (next < 0x80 || next > 0x8F))
        return NULL; /* past U+10FFFF */
    if (c >= 0xF0 && c <= 0xF4)
        return cont(p + 1, end, 3) ? p + 4 : NULL;
    return NULL;
}

/* After an opening quote: the end of the string, or NULL. */
static const unsigned char *
scan_string(const unsigned char *p, const unsigned char *end)
{
    while (p < end) {
        unsigned c = *p;
        if (c == '"')
            return p + 1;
        if (c == '\\')
            p = scan_escape(p + 1, end);
        else if (c < 0x20)
            return NULL; /* a control character unescaped */
        else if (c < 0x80)
            p++;
        else
            p = scan_utf8(p, end);
        if (p == NULL)
            return NULL;
    }
    return NULL;
}

static const unsigned char *
scan_digits(const unsigned char *p, const unsigned char *end)
{
    if (p >= end || *p < '0' || *p > '9')
        return NULL;
    while (p < end && *p >= '0' && *p <= '9')
        p++;
    return p;
}

/* A number: its end, or NULL (also where it is infinite as a double, as
 * orjson refuses it; integers of up to 19 digits never are). */
static const unsigned char *
scan_number(const unsigned char *p, const unsigned char *end)
{
    const unsigned char *start = p;
    int real = 0;
    if (p < end && *p == '-')
        p++;
    if (p < end && *p == '0')
        p++;
    else if ((p = scan_digits(p, end)) == NULL)
        return NULL;
    if (p < end && *p == '.') {
        if ((p = scan_digits(p + 1, end)) == NULL)
            return NULL;
        real = 1;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if ((p = scan_digits(p, end)) == NULL)
            return NULL;
        real = 1;
    }
    if (real || p - start > 19) {
        /* The bytes object ends with a NUL, and what follows a number is
         * no part of one: the parse stops at its end. */
        char *stop;
        double d = PyOS_string_to_double((const char *)start, &stop, NULL);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;
        }
        if (Py_IS_INFINITY(d))
            return NULL;
    }
    return p;
}

static const unsigned char *
scan_word(const unsigned char *p, const unsigned char *end, const char *word, Py_ssize_t n)
{
    return end - p >= n && memcmp(p, word, (size_t)n) == 0 ? p + n : NULL;
}

static int
json_object(const unsigned char *p, const unsigned char *end)
{
    char closing[MAX_DEPTH]; /* each open container's closing bracket */
    int depth = 0;
    p = skip_ws(p, end);
    if (p >= end || *p != '{')
        return 0;
value: /* p: a value's first byte */
    if (p >= end)
        return 0;
    switch (*p) {
    case '{':
    case '[':
        if (depth == MAX_DEPTH)
            return 0;
        closing[depth++] = *p == '{' ? '}' : ']';
        p = skip_ws(p + 1, end);
        if (p < end && *p == closing[depth - 1]) {
            depth--;
            p++;
            goto after;
        }
        if (closing[depth - 1] == '}')
            goto key;
        goto value;
    case '"':
        p = scan_string(p + 1, end);
        break;
    case 't':
        p = scan_word(p, end, "true", 4);
        break;
    case 'f':
        p = scan_word(p, end, "false", 5);
        break;
    case 'n':
        p = scan_word(p, end, "null", 4);
        break;
    default:
        p = scan_number(p, end);
    }
    if (p == NULL)
        return 0;
after: /* p: just past a value */
    p = skip_ws(p, end);
    if (depth == 0)
        return p == end;
    if (p < end && *p == ',') {
        p = skip_ws(p + 1, end);
        if (closing[depth - 1] == '}')
            goto key;
        goto value;
    }
    if (p >= end || *p != closing[depth - 1])
        return 0;
    depth--;
    p++;
    goto after;
key: /* p: a member's first byte */
    if (p >= end || *p != '"' || (p = scan_string(p + 1, end)) == NULL)
        return 0;
    p = skip_ws(p, end);
    if (p >= end || *p != ':')
        return 0;
    p = skip_ws(p + 1, end);
    goto value;
}

static PyObject *
is_object(PyObject *Py_UNUSED(module), PyObject *raw)
{
    if (!PyBytes_Check(raw)) {
        PyErr_SetString(PyExc_TypeError, "is_object(raw: bytes)");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(raw);
    return PyBool_FromLong(json_object(p, p + PyBytes_GET_SIZE(raw)));
}

/* -- token ids hidden ---------------------------------------------------------- */

/* hide_ids(data): continuation.book.hide_ids_reference's bytes, exactly
 * (tests/test_hide_ids.py compares the two): each "token_ids":\s*\[[^\]]*\]
 * nulled, then, in what that leaves, each "prompt_token_ids":\s*\[[^\]]*\].
 * Two scans, as the two regex substitutions, since the first can change what
 * the second matches ("prompt_token_ids":["token_ids":[1],2] ends at the 2's
 * bracket once the inner one is nulled). The same object back where nothing
 * is nulled (re.sub does so too). */

static int
is_space(char c)
{
    /* \s of a bytes pattern: [ \t\n\r\f\v] */
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* One substitution of `key` (a literal ending in ':') followed by a bracketed
 * list, over d[0:n), into *out. 0: nothing matched (*out untouched); 1: *out
 * holds the result; -1: no memory. */
static int
null_lists(const char *d, Py_ssize_t n, const char *key, Py_ssize_t kn, Out *out)
{
    Py_ssize_t from = 0, copied = 0;
    int hit = 0;
    for (;;) {
        /* memmem, not find(): JSON's many quotes would stop find() at each. */
        const char *hit_at = memmem(d + from, (size_t)(n - from), key, (size_t)kn);
        if (hit_at == NULL)
            break;
        Py_ssize_t at = hit_at - d;
        Py_ssize_t q = at + kn;
        while (q < n && is_space(d[q]))
            q++;
        if (q < n && d[q] == '[') {
            const char *close = memchr(d + q + 1, ']', (size_t)(n - q - 1));
            if (close == NULL)
                break; /* no ']' after this one: none after a later one either */
            if (out_put(out, d + copied, at - copied) < 0 || out_put(out, key, kn) < 0
                || out_put(out, "null", 4) < 0)
                return -1;
            hit = 1;
            copied = from = (close - d) + 1;
        } else {
            from = at + 1;
        }
    }
    if (!hit)
        return 0;
    return out_put(out, d + copied, n - copied) < 0 ? -1 : 1;
}

#define KEY(lit) (lit), (Py_ssize_t)(sizeof(lit) - 1)

static PyObject *
hide_ids(PyObject *Py_UNUSED(module), PyObject *data)
{
    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "hide_ids() takes bytes, not %.100s",
                     Py_TYPE(data)->tp_name);
        return NULL;
    }
    const char *d = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    Out first = {NULL, 0, 0}, second = {NULL, 0, 0};
    PyObject *result = NULL;
    int r1 = null_lists(d, n, KEY("\"token_ids\":"), &first);
    if (r1 < 0)
        goto done;
    if (r1 == 1) {
        d = first.p;
        n = first.len;
    }
    int r2 = null_lists(d, n, KEY("\"prompt_token_ids\":"), &second);
    if (r2 < 0)
        goto done;
    if (r2 == 1)
        result = PyBytes_FromStringAndSize(second.p, second.len);
    else if (r1 == 1)
        result = PyBytes_FromStringAndSize(first.p, first.len);
    else
        result = Py_NewRef(data);
done:
    PyMem_Free(first.p);
    PyMem_Free(second.p);
    return result;
}

static PyMethodDef module_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "The exception for an event over max_event bytes, and that bound."},
    {"is_object", (PyCFunction)is_object, METH_O,
     "Whether a whole answer's body is a JSON object, as orjson reads it."},
    {"hide_ids", (PyCFunction)hide_ids, METH_O,
     "Token-id fields nulled, as continuation.book.hide_ids_reference does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "proxy.dataplane._events",
    .m_doc = "The per-read event path of a stream, compiled (proxy.dataplane.sse: the reference).",
    .m_size = -1,
    .m_methods = module_methods,
};

#define INTERN(var, lit)                          \
    if ((var = PyUnicode_InternFromString(lit)) == NULL) \
        return NULL;

PyMODINIT_FUNC
PyInit__events(void)
{
    INTERN(s_generated, "generated");
    INTERN(s_records, "records");
    INTERN(s_cap, "cap");
    INTERN(s_is_closing, "is_closing");
    INTERN(s_write, "write");
    INTERN(s_buffer_size, "get_write_buffer_size");
    if (PyType_Ready(&ParserType) < 0 || PyType_Ready(&StreamType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Parser", (PyObject *)&ParserType) < 0
        || PyModule_AddObjectRef(m, "Stream", (PyObject *)&StreamType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
