/* A streamed answer's chunked body, decoded without a Python call per chunk.
 *
 * llhttp (httptools) reads every answer's head. A rank streams each SSE
 * event as one HTTP chunk; once a chunked answer's head is in, this decoder
 * reads its body, one call per read (proxy.upstream.client._Conn). It takes
 * only the plain form of a data chunk, `HEX CRLF data CRLF`. At a chunk
 * boundary anything else (the last chunk, a chunk extension, whitespace, a
 * size of more than 15 digits) is handed back, from that boundary on, to
 * llhttp: llhttp's state at every chunk boundary is the one it has at the
 * body's start, so it reads the rest of the answer (the last chunk, trailer
 * fields, its own errors) as it would have read the whole. The one error
 * found here is data not followed by CRLF (llhttp refuses it too): the data
 * before it is handed on all the same, as llhttp hands on what it read
 * before an error, and `broken` says so.
 *
 * feed_to() hands the data to the response itself, as RankResponse._body
 * does: to its direct reader (a stream's pump) if it has one, else to
 * _body, with no Python frame between the read and the reader. A Reader is
 * the connection's data callback while the body is the decoder's: it does
 * what _Conn.data_received does then (the read's time, feed_to), so that
 * from the socket to the client there is no Python frame at all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

/* A size line's digits, at most: 15 hex digits are 60 bits, no overflow. */
#define MAX_DIGITS 15

typedef enum {
    SIZE,    /* at a boundary, or within a size line's digits */
    SIZE_LF, /* the size line's CR came */
    DATA,    /* `left` data bytes still to come */
    DATA_CR, /* the data's CRLF is due */
    DATA_LF,
    HANDED,  /* llhttp reads the rest */
    BROKEN,  /* data not followed by CRLF */
} State;

typedef struct {
    PyObject_HEAD
    State state;
    char line[MAX_DIGITS + 1]; /* the size line so far: handed back with the rest */
    Py_ssize_t line_len;
    Py_ssize_t left;
    /* The reads with no data byte since the last one with some, in bytes, as
     * llhttp alone counts them (client._Conn.dry): each read counts whole,
     * the one handed on too, which is not llhttp's to count again. */
    Py_ssize_t dry;
} Dechunker;

static int
hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* (body, rest): the data of this read's chunks, and None, or the bytes from
 * the boundary where llhttp takes over (the size line so far, then the read's
 * rest), or b"" once broken. */
static PyObject *
result(PyObject *body, Dechunker *self, const char *rest, Py_ssize_t n)
{
    PyObject *tail = Py_None;
    Py_INCREF(tail);
    if (self->state == BROKEN) {
        Py_DECREF(tail);
        tail = PyBytes_FromStringAndSize(NULL, 0);
        if (tail == NULL) {
            Py_DECREF(body);
            return NULL;
        }
    } else if (rest != NULL) {
        Py_DECREF(tail);
        tail = PyBytes_FromStringAndSize(NULL, self->line_len + n);
        if (tail == NULL) {
            Py_DECREF(body);
            return NULL;
        }
        memcpy(PyBytes_AS_STRING(tail), self->line, (size_t)self->line_len);
        if (n > 0)
            memcpy(PyBytes_AS_STRING(tail) + self->line_len, rest, (size_t)n);
        self->state = HANDED;
        self->line_len = 0;
    }
    PyObject *pair = PyTuple_Pack(2, body, tail);
    Py_DECREF(body);
    Py_DECREF(tail);
    return pair;
}

static PyObject *s_direct, *s_undirect, *s_body;

static PyObject *
decode(Dechunker *self, PyObject *arg)
{
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "feed() takes bytes");
        return NULL;
    }
    if (self->state == HANDED || self->state == BROKEN) {
        PyErr_SetString(PyExc_RuntimeError, "the body was handed to llhttp, or is broken");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg), i = 0, w = 0;
    /* The data is never longer than the read: one buffer, cut to size. */
    PyObject *body = PyBytes_FromStringAndSize(NULL, n);
    if (body == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(body);
    const char *handoff = NULL;
    while (i < n && handoff == NULL && self->state != BROKEN) {
        char c = p[i];
        int v;
        switch (self->state) {
        case SIZE:
            if ((v = hex_value(c)) >= 0 && self->line_len < MAX_DIGITS) {
                self->line[self->line_len++] = c;
                self->left = self->left * 16 + v;
                i++;
            } else if (c == '\r' && self->line_len > 0) {
                self->line[self->line_len++] = c;
                self->state = SIZE_LF;
                i++;
            } else {
                handoff = p + i;
            }
            break;
        case SIZE_LF:
            if (c != '\n' || self->left == 0) { /* the last chunk, or no plain line */
                handoff = p + i;
                break;
            }
            self->line_len = 0;
            self->state = DATA;
            i++;
            break;
        case DATA: {
            Py_ssize_t take = n - i < self->left ? n - i : self->left;
            memcpy(out + w, p + i, (size_t)take);
            w += take;
            i += take;
            self->left -= take;
            if (self->left == 0)
                self->state = DATA_CR;
            break;
        }
        case DATA_CR:
        case DATA_LF:
            if (c != (self->state == DATA_CR ? '\r' : '\n')) {
                self->state = BROKEN;
                break;
            }
            self->state = self->state == DATA_CR ? DATA_LF : SIZE;
            i++;
            break;
        case HANDED:
        case BROKEN:
            break;
        }
    }
    /* A read of a few bytes at most between two data bytes (a size line is
     * at most 15 digits): no bound needed here, only the count handed on. */
    self->dry = w > 0 ? 0 : self->dry + n;
    if (w < n && _PyBytes_Resize(&body, w) < 0)
        return NULL;
    return result(body, self, handoff, handoff == NULL ? 0 : n - (handoff - p));
}

static PyObject *
Dechunker_feed(Dechunker *self, PyObject *arg)
{
    return decode(self, arg);
}

/* The exception being raised, taken (PyErr_GetRaisedException from 3.12). */
static PyObject *
take_raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* The body's data to `resp` (RankResponse._body's first half, its second
 * in Python): its direct reader's verdict False, or what it raised (an
 * Exception), ends the direct reading (RankResponse._undirect). */
static int
hand_on(PyObject *resp, PyObject *body)
{
    PyObject *direct = PyObject_GetAttr(resp, s_direct);
    if (direct == NULL)
        return -1;
    if (direct == Py_None) {
        Py_DECREF(direct);
        PyObject *done = PyObject_CallMethodOneArg(resp, s_body, body);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    PyObject *verdict = PyObject_CallOneArg(direct, body);
    Py_DECREF(direct);
    int more = verdict ? PyObject_IsTrue(verdict) : -1;
    Py_XDECREF(verdict);
    if (more > 0)
        return 0;
    PyObject *exc = Py_None;
    if (more < 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1; /* CancelledError and the like go on up, as from _body */
        exc = take_raised();
    } else {
        Py_INCREF(exc);
    }
    PyObject *done = PyObject_CallMethodOneArg(resp, s_undirect, exc);
    Py_DECREF(exc);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static PyObject *
Dechunker_feed_to(Dechunker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "feed_to(data: bytes, response)");
        return NULL;
    }
    PyObject *pair = decode(self, args[0]);
    if (pair == NULL)
        return NULL;
    PyObject *body = PyTuple_GET_ITEM(pair, 0), *rest = PyTuple_GET_ITEM(pair, 1);
    if (PyBytes_GET_SIZE(body) > 0 && hand_on(args[1], body) < 0) {
        Py_DECREF(pair);
        return NULL;
    }
    Py_INCREF(rest);
    Py_DECREF(pair);
    return rest;
}

/* -- the connection's data callback while the body is the decoder's ------ */

/* Reader(dechunker, response, clock, rest): the read's time (`clock()`, the
 * loop's time, as _Conn.data_received stamps it) into `read_at`, its data
 * handed to the response (feed_to), and what is left from a chunk boundary
 * on, if anything, to `rest` (Python: llhttp reads it, and the reads after
 * it). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Dechunker *chunks;
    PyObject *resp, *clock, *rest;
    double read_at;
} Reader;

static int
Reader_traverse(Reader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->chunks);
    Py_VISIT(self->resp);
    Py_VISIT(self->clock);
    Py_VISIT(self->rest);
    return 0;
}

static int
Reader_clear(Reader *self)
{
    Py_CLEAR(self->chunks);
    Py_CLEAR(self->resp);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->rest);
    return 0;
}

static void
Reader_dealloc(Reader *self)
{
    PyObject_GC_UnTrack(self);
    Reader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Reader_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Reader *self = (Reader *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a Reader takes one read (bytes)");
        return NULL;
    }
    PyObject *now = PyObject_CallNoArgs(self->clock);
    if (now == NULL)
        return NULL;
    double at = PyFloat_AsDouble(now);
    Py_DECREF(now);
    if (at == -1.0 && PyErr_Occurred())
        return NULL;
    self->read_at = at;
    PyObject *feed[2] = {args[0], self->resp};
    PyObject *left = Dechunker_feed_to(self->chunks, feed, 2);
    if (left == NULL || left == Py_None)
        return left;
    PyObject *done = PyObject_CallOneArg(self->rest, left);
    Py_DECREF(left);
    return done;
}

static PyTypeObject DechunkerType;

static PyObject *
Reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *chunks, *resp, *clock, *rest;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Reader() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OOO:Reader", &DechunkerType, &chunks, &resp, &clock, &rest))
        return NULL;
    Reader *self = (Reader *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = Reader_call;
    self->chunks = (Dechunker *)Py_NewRef(chunks);
    self->resp = Py_NewRef(resp);
    self->clock = Py_NewRef(clock);
    self->rest = Py_NewRef(rest);
    return (PyObject *)self;
}

static PyMemberDef Reader_members[] = {
    {"read_at", T_DOUBLE, offsetof(Reader, read_at), READONLY,
     "The loop's time of the last read (0.0 before any)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.upstream._framing.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A connection's data callback while a chunked body is the decoder's.",
    .tp_new = Reader_new,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_traverse = (traverseproc)Reader_traverse,
    .tp_clear = (inquiry)Reader_clear,
    .tp_vectorcall_offset = offsetof(Reader, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_members = Reader_members,
};

static PyObject *
Dechunker_at_boundary(Dechunker *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->state == SIZE && self->line_len == 0);
}

static PyMethodDef Dechunker_methods[] = {
    {"feed", (PyCFunction)Dechunker_feed, METH_O,
     "A read of the body in: (its chunks' data, None or the rest for llhttp)."},
    {"feed_to", (PyCFunction)(void (*)(void))Dechunker_feed_to, METH_FASTCALL,
     "feed(), its data handed to the response: None, or the rest for llhttp."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
Dechunker_broken(Dechunker *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->state == BROKEN);
}

static PyGetSetDef Dechunker_getset[] = {
    {"at_boundary", (getter)Dechunker_at_boundary, NULL, "Between two chunks.", NULL},
    {"broken", (getter)Dechunker_broken, NULL, "A chunk's data was not followed by CRLF.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Dechunker_members[] = {
    {"dry", T_PYSSIZET, offsetof(Dechunker, dry), 0,
     "Bytes of the reads since the last data byte, this one whole (set: where it starts)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject DechunkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.upstream._framing.Dechunker",
    .tp_basicsize = sizeof(Dechunker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A chunked body's plain data chunks, decoded; the rest handed to llhttp.",
    .tp_new = PyType_GenericNew,
    .tp_methods = Dechunker_methods,
    .tp_getset = Dechunker_getset,
    .tp_members = Dechunker_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_framing", "A streamed answer's chunked body, decoded.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__framing(void)
{
    if ((s_direct = PyUnicode_InternFromString("_direct")) == NULL
        || (s_undirect = PyUnicode_InternFromString("_undirect")) == NULL
        || (s_body = PyUnicode_InternFromString("_body")) == NULL)
        return NULL;
    if (PyType_Ready(&DechunkerType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&DechunkerType);
    if (PyModule_AddObject(m, "Dechunker", (PyObject *)&DechunkerType) < 0) {
        Py_DECREF(&DechunkerType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
