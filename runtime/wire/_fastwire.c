/* The signed one-frame message, both ways, in compiled code: `codec.one_sender`'s check, `codec.one_signer`'s
 * sign and `protocol.unpack`, with the same results and errors as their Python versions in codec.py and
 * protocol/base.py (which stay, and serve wherever this is not built).
 *
 * Why: on a machine with fewer cores than workers, each command wakes every worker, and each runs its command
 * path cold. There, every distinct Python function on that path costs about 1.5 us a worker (30 distinct trivial
 * functions added 40-55 us a no-op call per worker at 64 workers on 2 cores; the same function called 30 times,
 * 10-19 us): the interpreter's code and data are private to each process, while a compiled module's code is
 * one copy that every worker shares.
 *
 * A message's first frame: signature (32 bytes, keyed BLAKE2b of the rest) | mesh id (u32) | sender rank (i32)
 * | sequence number (u64) | header length (u32) | header (pickled) | body; all little-endian. The bytes come
 * from a socket: every length is checked before it is used, the signature before anything is unpickled. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#ifdef Py_T_OBJECT_EX
#define SLOT_OBJECT Py_T_OBJECT_EX
#define SLOT_READONLY Py_READONLY
#else
#include <structmember.h>
#define SLOT_OBJECT T_OBJECT_EX
#define SLOT_READONLY READONLY
#endif
#include <string.h>

#define SIG 32
#define ENVELOPE 20
#define FIXED (SIG + ENVELOPE)
#define SMALL 65536

static PyObject *str_digest;

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const unsigned char *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* The keyed BLAKE2b of `len` bytes at `data` (hashlib's, called here: no Python code runs), as bytes. */
static PyObject *mac_of(PyObject *blake2b, PyObject *mac_kwargs, const void *data, Py_ssize_t len) {
    PyObject *view = PyMemoryView_FromMemory((char *)data, len, PyBUF_READ);
    if (view == NULL) return NULL;
    PyObject *args = PyTuple_Pack(1, view);
    Py_DECREF(view);
    if (args == NULL) return NULL;
    PyObject *h = PyObject_Call(blake2b, args, mac_kwargs);
    Py_DECREF(args);
    if (h == NULL) return NULL;
    PyObject *digest = PyObject_CallMethodNoArgs(h, str_digest);
    Py_DECREF(h);
    if (digest != NULL && (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) != SIG)) {
        Py_DECREF(digest);
        PyErr_SetString(PyExc_RuntimeError, "the MAC is not 32 bytes");
        return NULL;
    }
    return digest;
}

/* Where each of `names` lives in an instance of `cls`, as bytes holding one Py_ssize_t offset each: where every
 * one is a writable object slot (a slotted dataclass's fields); else None, and `make` sets them as attributes. */
static PyObject *slot_offsets(PyObject *cls, PyObject *names) {
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    PyObject *got = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(Py_ssize_t));
    if (got == NULL) return NULL;
    Py_ssize_t *at = (Py_ssize_t *)PyBytes_AS_STRING(got);
    PyTypeObject *type = (PyTypeObject *)cls;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *descr = _PyType_Lookup(type, PyTuple_GET_ITEM(names, i)); /* (borrowed) */
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) goto none;
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != SLOT_OBJECT || (member->flags & SLOT_READONLY) || member->offset < 0 ||
            member->offset + (Py_ssize_t)sizeof(PyObject *) > type->tp_basicsize ||
            !PyType_IsSubtype(type, ((PyDescrObject *)descr)->d_type))
            goto none;
        at[i] = member->offset;
    }
    return got;
none:
    Py_DECREF(got);
    Py_RETURN_NONE;
}

/* `obj` of type `cls` (a slotted dataclass: its generated __init__ only sets its fields) made with `values` set
 * on `names` (straight into its slots where `offsets`, from `slot_offsets`, is bytes), without running that
 * __init__ (a Python function, run cold). */
static PyObject *make(PyObject *cls, PyObject *names, PyObject *offsets, PyObject *const *values, Py_ssize_t n) {
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) return NULL;
    PyObject *obj = type->tp_new(type, empty, NULL);
    Py_DECREF(empty);
    if (obj == NULL) return NULL;
    if (PyBytes_Check(offsets) && PyBytes_GET_SIZE(offsets) == n * (Py_ssize_t)sizeof(Py_ssize_t)) {
        const Py_ssize_t *at = (const Py_ssize_t *)PyBytes_AS_STRING(offsets);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject **slot = (PyObject **)((char *)obj + at[i]);
            PyObject *old = *slot;
            Py_INCREF(values[i]);
            *slot = values[i];
            Py_XDECREF(old);
        }
        return obj;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_SetAttr(obj, PyTuple_GET_ITEM(names, i), values[i]) < 0) {
            Py_DECREF(obj);
            return NULL;
        }
    }
    return obj;
}

/* -- the check ----------------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    uint32_t mesh_id;
    int32_t rank;
    PyObject *seen;       /* list: seen[rank] (a negative rank counts from the end, as Python's index does) */
    PyObject *envelope;   /* codec.Envelope */
    PyObject *env_names;  /* its field names, in order */
    PyObject *env_offsets; /* where they live (`slot_offsets`) */
    PyObject *blake2b;
    PyObject *mac_kwargs; /* {"key": key, "digest_size": 32} */
    PyObject *loads;      /* pickle.loads */
} Checker;

static void Checker_dealloc(Checker *self) {
    Py_XDECREF(self->seen);
    Py_XDECREF(self->envelope);
    Py_XDECREF(self->env_names);
    Py_XDECREF(self->env_offsets);
    Py_XDECREF(self->blake2b);
    Py_XDECREF(self->mac_kwargs);
    Py_XDECREF(self->loads);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *check(Checker *self, const unsigned char *p, Py_ssize_t size) {
    if (size < FIXED || size >= SMALL + SIG) Py_RETURN_NONE;
    uint32_t m = get_u32(p + SIG);
    int32_t r = (int32_t)get_u32(p + SIG + 4);
    uint64_t seq = get_u64(p + SIG + 8);
    uint32_t n = get_u32(p + SIG + 16);
    if (m != self->mesh_id || r != self->rank || (uint64_t)FIXED + n > (uint64_t)size) Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(self->seen);
    Py_ssize_t at = self->rank < 0 ? count + self->rank : self->rank;
    if (at < 0 || at >= count) {
        PyErr_SetString(PyExc_IndexError, "no sequence number kept for this sender");
        return NULL;
    }
    PyObject *seq_obj = PyLong_FromUnsignedLongLong(seq);
    if (seq_obj == NULL) return NULL;
    int old = PyObject_RichCompareBool(seq_obj, PyList_GET_ITEM(self->seen, at), Py_LE);
    if (old != 0) {
        Py_DECREF(seq_obj);
        if (old < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *mac = mac_of(self->blake2b, self->mac_kwargs, p + SIG, size - SIG);
    if (mac == NULL) {
        Py_DECREF(seq_obj);
        return NULL;
    }
    const unsigned char *want = (const unsigned char *)PyBytes_AS_STRING(mac);
    unsigned char diff = 0;
    for (int i = 0; i < SIG; i++) diff |= (unsigned char)(want[i] ^ p[i]); /* (constant time) */
    Py_DECREF(mac);
    if (diff) {
        Py_DECREF(seq_obj);
        Py_RETURN_NONE;
    }
    PyObject *head = PyMemoryView_FromMemory((char *)p + FIXED, n, PyBUF_READ);
    if (head == NULL) {
        Py_DECREF(seq_obj);
        return NULL;
    }
    PyObject *message = PyObject_CallOneArg(self->loads, head);
    Py_DECREF(head);
    if (message == NULL) { /* (nothing changed: the caller's `decode` says what is wrong) */
        Py_DECREF(seq_obj);
        return NULL;
    }
    PyObject *values[6] = {PyLong_FromUnsignedLong(m), PyLong_FromLong(r), seq_obj, message,
                           PyBytes_FromStringAndSize((const char *)p + FIXED + n, size - FIXED - n), PyList_New(0)};
    PyObject *env = NULL;
    if (values[0] && values[1] && values[4] && values[5]) env = make(self->envelope, self->env_names, self->env_offsets, values, 6);
    if (env != NULL) { /* only now: a header that does not unpickle raises, and nothing changed */
        Py_INCREF(seq_obj);
        PyList_SetItem(self->seen, at, seq_obj); /* (steals the reference) */
    }
    for (int i = 0; i < 6; i++) Py_XDECREF(values[i]);
    return env;
}

static PyObject *Checker_call(Checker *self, PyObject *args, PyObject *kwargs) {
    PyObject *first;
    if (!PyArg_ParseTuple(args, "O:check", &first)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(first, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *got = check(self, (const unsigned char *)view.buf, view.len);
    PyBuffer_Release(&view);
    return got;
}

static PyTypeObject CheckerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "monarch.runtime.wire._fastwire.Checker",
    .tp_basicsize = sizeof(Checker),
    .tp_dealloc = (destructor)Checker_dealloc,
    .tp_call = (ternaryfunc)Checker_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "codec.one_sender's check, compiled: check(first frame) -> Envelope | None",
};

static PyObject *one_sender(PyObject *module, PyObject *args) {
    unsigned int mesh_id;
    int rank;
    PyObject *seen, *envelope, *env_names, *blake2b, *mac_kwargs, *loads;
    if (!PyArg_ParseTuple(args, "IiO!OO!OO!O:one_sender", &mesh_id, &rank, &PyList_Type, &seen, &envelope,
                          &PyTuple_Type, &env_names, &blake2b, &PyDict_Type, &mac_kwargs, &loads))
        return NULL;
    if (!PyType_Check(envelope) || PyTuple_GET_SIZE(env_names) != 6) {
        PyErr_SetString(PyExc_TypeError, "one_sender: the envelope must be a class of six fields");
        return NULL;
    }
    PyObject *offsets = slot_offsets(envelope, env_names);
    if (offsets == NULL) return NULL;
    Checker *self = PyObject_New(Checker, &CheckerType);
    if (self == NULL) {
        Py_DECREF(offsets);
        return NULL;
    }
    self->env_offsets = offsets;
    self->mesh_id = mesh_id;
    self->rank = rank;
    Py_INCREF(seen);
    self->seen = seen;
    Py_INCREF(envelope);
    self->envelope = envelope;
    Py_INCREF(env_names);
    self->env_names = env_names;
    Py_INCREF(blake2b);
    self->blake2b = blake2b;
    Py_INCREF(mac_kwargs);
    self->mac_kwargs = mac_kwargs;
    Py_INCREF(loads);
    self->loads = loads;
    return (PyObject *)self;
}

/* -- the signer ---------------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    uint32_t mesh_id;
    int32_t rank;
    PyObject *blake2b;
    PyObject *mac_kwargs;
    PyObject *dumps; /* pickle.dumps, protocol 5 */
} Signer;

static void Signer_dealloc(Signer *self) {
    Py_XDECREF(self->blake2b);
    Py_XDECREF(self->mac_kwargs);
    Py_XDECREF(self->dumps);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Signer_call(Signer *self, PyObject *args, PyObject *kwargs) {
    unsigned long long seq;
    PyObject *message, *body_obj;
    if (!PyArg_ParseTuple(args, "KOO:sign", &seq, &message, &body_obj)) return NULL;
    PyObject *h = PyObject_CallOneArg(self->dumps, message);
    if (h == NULL) return NULL;
    if (!PyBytes_Check(h)) {
        Py_DECREF(h);
        PyErr_SetString(PyExc_TypeError, "sign: the pickler gave no bytes");
        return NULL;
    }
    Py_buffer body;
    if (PyObject_GetBuffer(body_obj, &body, PyBUF_SIMPLE) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    Py_ssize_t hn = PyBytes_GET_SIZE(h), total = ENVELOPE + hn + body.len;
    PyObject *got = NULL;
    if (total >= SMALL || hn > 0xFFFFFFFF) {
        Py_INCREF(Py_None);
        got = Py_None;
        goto done;
    }
    PyObject *meta = PyBytes_FromStringAndSize(NULL, total);
    if (meta == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(meta);
    put_u32(p, self->mesh_id);
    put_u32(p + 4, (uint32_t)self->rank);
    put_u32(p + 8, (uint32_t)seq);
    put_u32(p + 12, (uint32_t)(seq >> 32));
    put_u32(p + 16, (uint32_t)hn);
    memcpy(p + ENVELOPE, PyBytes_AS_STRING(h), hn);
    if (body.len) memcpy(p + ENVELOPE + hn, body.buf, body.len);
    PyObject *mac = mac_of(self->blake2b, self->mac_kwargs, p, total);
    if (mac == NULL) {
        Py_DECREF(meta);
        goto done;
    }
    got = PyList_New(2);
    if (got == NULL) {
        Py_DECREF(mac);
        Py_DECREF(meta);
        goto done;
    }
    PyList_SET_ITEM(got, 0, mac);
    PyList_SET_ITEM(got, 1, meta);
done:
    PyBuffer_Release(&body);
    Py_DECREF(h);
    return got;
}

static PyTypeObject SignerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "monarch.runtime.wire._fastwire.Signer",
    .tp_basicsize = sizeof(Signer),
    .tp_dealloc = (destructor)Signer_dealloc,
    .tp_call = (ternaryfunc)Signer_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "codec.one_signer's sign, compiled: sign(seq, message, body) -> [signature, rest] | None",
};

static PyObject *one_signer(PyObject *module, PyObject *args) {
    unsigned int mesh_id;
    int rank;
    PyObject *blake2b, *mac_kwargs, *dumps;
    if (!PyArg_ParseTuple(args, "IiOO!O:one_signer", &mesh_id, &rank, &blake2b, &PyDict_Type, &mac_kwargs, &dumps))
        return NULL;
    Signer *self = PyObject_New(Signer, &SignerType);
    if (self == NULL) return NULL;
    self->mesh_id = mesh_id;
    self->rank = rank;
    Py_INCREF(blake2b);
    self->blake2b = blake2b;
    Py_INCREF(mac_kwargs);
    self->mac_kwargs = mac_kwargs;
    Py_INCREF(dumps);
    self->dumps = dumps;
    return (PyObject *)self;
}

/* -- unpack -------------------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    PyObject *types; /* protocol/base.py's _TYPES: the class of each tag, or None */
    PyObject *names; /* the field names of each, as a tuple (None where no class) */
    PyObject *offsets; /* class -> where its fields live (`slot_offsets`), found on its first message */
} Unpacker;

static void Unpacker_dealloc(Unpacker *self) {
    Py_XDECREF(self->types);
    Py_XDECREF(self->names);
    Py_XDECREF(self->offsets);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Unpacker_call(Unpacker *self, PyObject *args, PyObject *kwargs) {
    PyObject *t;
    if (!PyArg_ParseTuple(args, "O:unpack", &t)) return NULL;
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) == 0 || !PyLong_CheckExact(PyTuple_GET_ITEM(t, 0))) {
        PyErr_Format(PyExc_ValueError, "not a message: %s", _PyType_Name(Py_TYPE(t)));
        return NULL;
    }
    Py_ssize_t tag = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0));
    if (tag == -1 && PyErr_Occurred()) PyErr_Clear(); /* (too large: out of range below) */
    Py_ssize_t count = PyList_GET_SIZE(self->types);
    if (tag < 0 || tag >= count || PyList_GET_SIZE(self->names) != count) {
        PyErr_Format(PyExc_ValueError, "not a message: %s", _PyType_Name(Py_TYPE(t)));
        return NULL;
    }
    PyObject *cls = PyList_GET_ITEM(self->types, tag), *names = PyList_GET_ITEM(self->names, tag);
    if (cls == Py_None || !PyType_Check(cls) || !PyTuple_Check(names)) {
        PyErr_Format(PyExc_ValueError, "not a message: no message has tag %zd", tag);
        return NULL;
    }
    Py_ssize_t arity = PyTuple_GET_SIZE(names);
    if (PyTuple_GET_SIZE(t) != arity + 1) {
        PyErr_Format(PyExc_ValueError, "%s has %zd fields, got %zd", _PyType_Name((PyTypeObject *)cls), arity,
                     PyTuple_GET_SIZE(t) - 1);
        return NULL;
    }
    PyObject *offsets = PyDict_GetItemWithError(self->offsets, cls); /* (borrowed) */
    if (offsets == NULL) {
        if (PyErr_Occurred()) return NULL;
        offsets = slot_offsets(cls, names);
        if (offsets == NULL) return NULL;
        int failed = PyDict_SetItem(self->offsets, cls, offsets);
        Py_DECREF(offsets); /* (the dict holds it) */
        if (failed < 0) return NULL;
    }
    return make(cls, names, offsets, &PyTuple_GET_ITEM(t, 1), arity);
}

static PyTypeObject UnpackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "monarch.runtime.wire._fastwire.Unpacker",
    .tp_basicsize = sizeof(Unpacker),
    .tp_dealloc = (destructor)Unpacker_dealloc,
    .tp_call = (ternaryfunc)Unpacker_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "protocol.unpack, compiled: unpack((tag, *fields)) -> the message",
};

static PyObject *unpacker(PyObject *module, PyObject *args) {
    PyObject *types, *names;
    if (!PyArg_ParseTuple(args, "O!O!:unpacker", &PyList_Type, &types, &PyList_Type, &names)) return NULL;
    PyObject *offsets = PyDict_New();
    if (offsets == NULL) return NULL;
    Unpacker *self = PyObject_New(Unpacker, &UnpackerType);
    if (self == NULL) {
        Py_DECREF(offsets);
        return NULL;
    }
    self->offsets = offsets;
    Py_INCREF(types);
    self->types = types;
    Py_INCREF(names);
    self->names = names;
    return (PyObject *)self;
}

static PyMethodDef methods[] = {
    {"one_sender", one_sender, METH_VARARGS,
     "one_sender(mesh_id, rank, seen, Envelope, its field names, blake2b, {key, digest_size}, pickle.loads)"},
    {"one_signer", one_signer, METH_VARARGS, "one_signer(mesh_id, rank, blake2b, {key, digest_size}, dumps)"},
    {"unpacker", unpacker, METH_VARARGS, "unpacker(classes by tag, their field names by tag)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastwire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastwire(void) {
    if (PyType_Ready(&CheckerType) < 0 || PyType_Ready(&SignerType) < 0 || PyType_Ready(&UnpackerType) < 0)
        return NULL;
    str_digest = PyUnicode_InternFromString("digest");
    if (str_digest == NULL) return NULL;
    return PyModule_Create(&module);
}
