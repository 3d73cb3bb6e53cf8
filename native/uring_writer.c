/* ckptrun._uring: the engine's compiled file writer (io_uring + O_DIRECT).
 *
 * One Writer per output file. The bytes of a write_at() that cover whole 4 KiB pages go to an
 * O_DIRECT descriptor through an io_uring ring with up to `depth` pieces of `piece` bytes in
 * flight: straight from the caller's memory when it is 4 KiB-aligned, through aligned bounce
 * buffers otherwise. The partial pages at either end (a file's last < 4 KiB, an unaligned
 * offset) go through a second, buffered descriptor of the same file, so the file ends at
 * exactly the right length; so does a whole write of fewer than `small` bytes (an index, a
 * manifest, a small record: there the page cache beats a device round trip, which for a file
 * being extended goes through an io-wq worker thread, and no ring is set up). A file system
 * that refuses O_DIRECT (EINVAL) gets buffered writes through the same rings. write_at() returns once all its bytes are written (the
 * caller's memory is free again); sync() makes them durable (fsync). The GIL is released while
 * copying and waiting. Several threads may write one file at once: each call takes a ring of
 * the Writer's pool (a new one when all are busy); close() waits for the calls running.
 * Errors are OSError with the errno of the failing write.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ALIGN 4096u
#define MAX_DEPTH 64u

/* One caller's ring and bounce buffers; a Writer keeps the idle ones for its next callers. */
typedef struct Ring {
    struct io_uring ring;
    int ok;
    char *bounce; /* depth * piece bytes, 4 KiB-aligned, allocated on first need */
    struct Ring *next;
} Ring;

typedef struct {
    PyObject_HEAD
    int fd;     /* O_DIRECT when `direct`; -1 once closed */
    int bfd;    /* buffered descriptor of the same file (== fd without O_DIRECT) */
    int direct; /* read and cleared with __atomic: a write may give O_DIRECT up (EINVAL) */
    unsigned depth;
    size_t piece;
    size_t small;       /* writes shorter than this go buffered (pwrite) */
    pthread_mutex_t lock; /* guards fd/bfd, users and spare */
    pthread_cond_t idle;  /* users dropped to 0 */
    unsigned users;       /* calls using the descriptors now: close waits for them */
    Ring *spare;
    PyObject *path;
} Writer;

typedef struct {
    const char *buf;
    size_t len;
    off_t off;
} Piece;

static int pwrite_all(int fd, const char *buf, size_t len, off_t off)
{
    while (len) {
        ssize_t n = pwrite(fd, buf, len, off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return EIO;
        buf += n, len -= (size_t)n, off += n;
    }
    return 0;
}

static void ring_free(Ring *r)
{
    if (r->ok)
        io_uring_queue_exit(&r->ring);
    free(r->bounce);
    free(r);
}

/* Write [src, src+len) at `off` of `fd` through ring `r`, `piece` bytes per request, up to
 * `depth` in flight; `bounce`: copy each piece into an aligned buffer first. On return nothing
 * is in flight. A ring that failed to submit or reap is left with ok = 0 (its owner frees it). */
static int ring_write(Writer *w, Ring *r, int fd, const char *src, size_t len, off_t off, int bounce)
{
    Piece pieces[MAX_DEPTH];
    unsigned spare[MAX_DEPTH], nspare = w->depth, inflight = 0;
    size_t pos = 0;
    int err = 0;
    if (!r->ok) {
        int e = io_uring_queue_init(w->depth, &r->ring, 0);
        if (e < 0)
            return -e;
        r->ok = 1;
    }
    if (bounce && r->bounce == NULL) {
        void *mem = NULL;
        if (posix_memalign(&mem, ALIGN, (size_t)w->depth * w->piece))
            return ENOMEM;
        r->bounce = mem;
    }
    for (unsigned i = 0; i < w->depth; i++)
        spare[i] = i;
    while ((pos < len && !err) || inflight) {
        unsigned queued = 0;
        while (pos < len && !err && nspare) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (sqe == NULL)
                break;
            unsigned s = spare[--nspare];
            size_t n = len - pos < w->piece ? len - pos : w->piece;
            const char *p = src + pos;
            if (bounce) {
                memcpy(r->bounce + (size_t)s * w->piece, p, n);
                p = r->bounce + (size_t)s * w->piece;
            }
            pieces[s] = (Piece){p, n, off + (off_t)pos};
            io_uring_prep_write(sqe, fd, p, (unsigned)n, (uint64_t)(off + (off_t)pos));
            io_uring_sqe_set_data64(sqe, s);
            pos += n, queued++;
        }
        while (queued) {
            int e = io_uring_submit(&r->ring);
            if (e == -EINTR || e == -EAGAIN)
                continue;
            if (e <= 0) { /* the unsubmitted entries must never reach the kernel later */
                err = e < 0 ? -e : EIO;
                break;
            }
            inflight += (unsigned)e, queued -= (unsigned)e;
        }
        if (queued) {
            while (inflight) { /* reap what was submitted, then the ring is given up */
                struct io_uring_cqe *cqe;
                int e = io_uring_wait_cqe(&r->ring, &cqe);
                if (e == -EINTR)
                    continue;
                if (e < 0)
                    break;
                io_uring_cqe_seen(&r->ring, cqe);
                inflight--;
            }
            io_uring_queue_exit(&r->ring);
            r->ok = 0;
            return err;
        }
        if (!inflight)
            continue;
        struct io_uring_cqe *cqe;
        int e = io_uring_wait_cqe(&r->ring, &cqe);
        if (e == -EINTR)
            continue;
        if (e < 0) {
            io_uring_queue_exit(&r->ring);
            r->ok = 0;
            return -e;
        }
        unsigned s = (unsigned)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&r->ring, cqe);
        inflight--;
        Piece *pc = &pieces[s];
        if (res == -EINVAL && fd != w->bfd) {
            /* O_DIRECT accepted at open but not for this write (e.g. a larger logical block):
             * this piece and every later write go buffered. */
            __atomic_store_n(&w->direct, 0, __ATOMIC_RELAXED);
            res = pwrite_all(w->bfd, pc->buf, pc->len, pc->off);
            if (res && !err)
                err = res;
        } else if (res < 0) {
            if (!err)
                err = -res;
        } else if ((size_t)res < pc->len) { /* short write: the rest, synchronously */
            int e2 = pwrite_all(w->bfd, pc->buf + res, pc->len - (size_t)res, pc->off + res);
            if (e2 && !err)
                err = e2;
        }
        spare[nspare++] = s;
    }
    return err;
}

/* Register a call that uses the descriptors (close waits for it); EBADF once closed. */
static int use_begin(Writer *w)
{
    int err = 0;
    pthread_mutex_lock(&w->lock);
    if (w->fd < 0)
        err = EBADF;
    else
        w->users++;
    pthread_mutex_unlock(&w->lock);
    return err;
}

static void use_end(Writer *w)
{
    pthread_mutex_lock(&w->lock);
    if (--w->users == 0)
        pthread_cond_broadcast(&w->idle);
    pthread_mutex_unlock(&w->lock);
}

/* The whole-page part through a ring of the pool (a new one when all are busy). */
static int pooled_write(Writer *w, int fd, const char *src, size_t len, off_t off, int bounce)
{
    pthread_mutex_lock(&w->lock);
    Ring *r = w->spare;
    if (r != NULL)
        w->spare = r->next;
    pthread_mutex_unlock(&w->lock);
    if (r == NULL && (r = calloc(1, sizeof *r)) == NULL)
        return ENOMEM;
    int err = ring_write(w, r, fd, src, len, off, bounce);
    if (!r->ok) { /* never set up, or given up after a failure */
        ring_free(r);
        return err;
    }
    pthread_mutex_lock(&w->lock);
    r->next = w->spare;
    w->spare = r;
    pthread_mutex_unlock(&w->lock);
    return err;
}

static int write_used(Writer *w, const char *buf, size_t len, off_t off)
{
    if (!len)
        return 0;
    if (len < w->small)
        return pwrite_all(w->bfd, buf, len, off);
    if (!__atomic_load_n(&w->direct, __ATOMIC_RELAXED)) /* bfd: also after O_DIRECT was given up */
        return pooled_write(w, w->bfd, buf, len, off, 0);
    off_t end = off + (off_t)len;
    off_t a = (off + ALIGN - 1) / ALIGN * ALIGN, b = end / ALIGN * ALIGN;
    if (a >= b)
        return pwrite_all(w->bfd, buf, len, off);
    int err = pwrite_all(w->bfd, buf, (size_t)(a - off), off);
    if (!err && end > b)
        err = pwrite_all(w->bfd, buf + (b - off), (size_t)(end - b), b);
    if (err)
        return err;
    const char *mid = buf + (a - off);
    return pooled_write(w, w->fd, mid, (size_t)(b - a), a, (uintptr_t)mid % ALIGN != 0);
}

static PyObject *raise_errno(Writer *w, int err)
{
    errno = err;
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, w->path);
}

static int Writer_init(Writer *w, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "depth", "piece", "direct", "small", "truncate", NULL};
    PyObject *path = NULL;
    unsigned depth = 8;
    Py_ssize_t piece = 1 << 20, small = 1 << 20;
    int direct = 1, truncate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|Inpnp", kwlist, PyUnicode_FSConverter, &path, &depth, &piece,
                                     &direct, &small, &truncate))
        return -1;
    if (w->path != NULL) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_RuntimeError, "Writer is already open");
        return -1;
    }
    if (depth < 1 || depth > MAX_DEPTH || piece < (Py_ssize_t)ALIGN || piece % ALIGN || piece > (1 << 30) ||
        small < 0) {
        Py_DECREF(path);
        PyErr_Format(PyExc_ValueError, "depth must be 1..%u, piece a multiple of %u up to 1 GiB, small >= 0",
                     MAX_DEPTH, ALIGN);
        return -1;
    }
    w->path = path;
    w->depth = depth, w->piece = (size_t)piece, w->small = (size_t)small;
    const char *p = PyBytes_AS_STRING(path);
    /* truncate=False: an existing file (a preallocated region) is written in place, never created */
    int flags = O_WRONLY | O_CLOEXEC | (truncate ? O_CREAT | O_TRUNC : 0), err = 0;
    Py_BEGIN_ALLOW_THREADS
    w->fd = direct ? open(p, flags | O_DIRECT, 0644) : -1;
    if (w->fd < 0 && (!direct || errno == EINVAL)) { /* tmpfs and friends refuse O_DIRECT */
        direct = 0;
        w->fd = open(p, flags, 0644);
    }
    if (w->fd < 0)
        err = errno;
    else if (direct) {
        struct stat a, b;
        w->bfd = open(p, O_WRONLY | O_CLOEXEC);
        if (w->bfd < 0)
            err = errno;
        else if (fstat(w->fd, &a) || fstat(w->bfd, &b))
            err = errno;
        else if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
            err = ESTALE; /* the path was replaced between the two opens */
    } else
        w->bfd = w->fd;
    Py_END_ALLOW_THREADS
    w->direct = direct;
    if (err) {
        if (w->bfd >= 0 && w->bfd != w->fd)
            close(w->bfd);
        if (w->fd >= 0)
            close(w->fd);
        w->fd = w->bfd = -1;
        raise_errno(w, err);
        return -1;
    }
    return 0;
}

static PyObject *Writer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Writer *w = (Writer *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->fd = w->bfd = -1;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->idle, NULL);
    return (PyObject *)w;
}

/* Close the descriptors and free the rings, once no call uses them (lock held). */
static int close_locked(Writer *w)
{
    int err = 0;
    while (w->users)
        pthread_cond_wait(&w->idle, &w->lock);
    while (w->spare != NULL) {
        Ring *r = w->spare;
        w->spare = r->next;
        ring_free(r);
    }
    if (w->bfd >= 0 && w->bfd != w->fd && close(w->bfd))
        err = errno;
    if (w->fd >= 0 && close(w->fd) && !err)
        err = errno;
    w->fd = w->bfd = -1;
    return err;
}

static void Writer_dealloc(Writer *w)
{
    pthread_mutex_lock(&w->lock); /* no call can be running: it would hold a reference */
    close_locked(w);
    pthread_mutex_unlock(&w->lock);
    pthread_cond_destroy(&w->idle);
    pthread_mutex_destroy(&w->lock);
    Py_XDECREF(w->path);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *Writer_write_at(Writer *w, PyObject *args)
{
    Py_buffer view;
    long long offset;
    if (!PyArg_ParseTuple(args, "y*L", &view, &offset))
        return NULL;
    if (offset < 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "negative offset");
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = use_begin(w);
    if (!err) {
        err = write_used(w, view.buf, (size_t)view.len, (off_t)offset);
        use_end(w);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (err)
        return raise_errno(w, err);
    Py_RETURN_NONE;
}

static PyObject *Writer_sync(Writer *w, PyObject *unused)
{
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = use_begin(w);
    if (!err) {
        if (fsync(w->fd))
            err = errno;
        use_end(w);
    }
    Py_END_ALLOW_THREADS
    if (err)
        return raise_errno(w, err);
    Py_RETURN_NONE;
}

static PyObject *Writer_close(Writer *w, PyObject *unused)
{
    int err;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    err = close_locked(w);
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    if (err)
        return raise_errno(w, err);
    Py_RETURN_NONE;
}

static PyObject *Writer_get_fd(Writer *w, void *closure) { return PyLong_FromLong(w->fd); }
static PyObject *Writer_get_direct(Writer *w, void *closure) { return PyBool_FromLong(w->direct); }

static PyMethodDef Writer_methods[] = {
    {"write_at", (PyCFunction)Writer_write_at, METH_VARARGS,
     "write_at(data, offset): write all of the contiguous buffer `data` at `offset`; returns once written."},
    {"sync", (PyCFunction)Writer_sync, METH_NOARGS, "sync(): fsync the file (everything written is durable)."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS, "close(): close the descriptors and free the ring."},
    {NULL},
};

static PyGetSetDef Writer_getset[] = {
    {"fd", (getter)Writer_get_fd, NULL, "The file's descriptor (O_DIRECT when `direct`); -1 once closed.", NULL},
    {"direct", (getter)Writer_get_direct, NULL, "Whether whole pages bypass the page cache (O_DIRECT).", NULL},
    {NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ckptrun._uring.Writer",
    .tp_doc = PyDoc_STR("Writer(path, depth=8, piece=1 MiB, direct=True, small=1 MiB, truncate=True): create or "
                        "truncate `path` (truncate=False: open the existing file, in place) and write it through "
                        "io_uring, whole pages with O_DIRECT; writes shorter than `small` and partial pages buffered."),
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Writer_new,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

static PyObject *probe(PyObject *self, PyObject *unused)
{
    /* io_uring can be compiled in yet refused (kernel.io_uring_disabled, seccomp): try a ring. */
    struct io_uring ring;
    int r = io_uring_queue_init(1, &ring, 0);
    if (r < 0) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    io_uring_queue_exit(&ring);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"probe", probe, METH_NOARGS, "probe(): raise OSError when this process cannot set up an io_uring ring."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "ckptrun._uring",
    .m_doc = "The engine's compiled writer: io_uring with O_DIRECT (see native/README.md).", .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__uring(void)
{
    if (PyType_Ready(&WriterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&WriterType);
    if (PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0) {
        Py_DECREF(&WriterType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
