/* pmetal.model._qk: the Python face of the kernels.
 *
 * What it owns: choosing the ISA table at import (AVX2 when the CPU has it,
 * NEON on arm64, else scalar; select_isa() narrows that for tests), checking
 * buffer sizes once more (pmetal/model/kernels.py validates arguments and
 * raises KernelError before calling here; a mismatch here is a bug there and
 * raises ValueError), quantizing x, and splitting the work into items for
 * qk_parallel.  The GIL is released while anything is computed.
 *
 * Work items are (matrix, block of output rows).  For each weight row of its
 * block an item computes every x row, so a weight row is read from memory
 * once per call and then from L1 for the other x rows.  Each output element
 * is computed start to finish by one dot call, the same call whatever R,
 * the item boundaries or the thread count, so its bits depend only on its x
 * row and its weight row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "qk.h"

static qk_isa g_isa;
static void isa_auto(void) {
#if defined(QK_HAVE_X86)
    if (qk_cpu_has_avx2()) { qk_fill_avx2(&g_isa); return; }
#endif
#if defined(QK_HAVE_NEON)
    qk_fill_neon(&g_isa);
    return;
#endif
    qk_fill_scalar(&g_isa);
}

/* ---------------------------------------------------------------- buffers */

typedef struct {
    Py_buffer view;
    int held;
} buf_t;

static int get_buf(PyObject *obj, buf_t *b, int writable, Py_ssize_t want, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held = 1;
    if (want >= 0 && b->view.len != want) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", what, b->view.len, want);
        return -1;
    }
    return 0;
}

static void rel_buf(buf_t *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

/* ----------------------------------------------------------------- matmul */

typedef struct {
    const uint8_t *w;
    float *out;
    qk_dot_fn dot;
    qk_dotn_fn dotn;
    int64_t rows, row_bytes, first_item;
    int n, rows_per_item;   /* n: blocks per row (values for float types) */
    const uint8_t *x;       /* prepared x rows */
    size_t x_stride;
} mm_mat;

typedef struct {
    mm_mat *m;
    int nmat, R;
} mm_job;

static void mm_item(void *ctx, int64_t item) {
    const mm_job *job = ctx;
    int k = 0;
    while (k + 1 < job->nmat && job->m[k + 1].first_item <= item) k++;
    const mm_mat *m = &job->m[k];
    const int64_t r0 = (item - m->first_item) * m->rows_per_item;
    const int64_t r1 = r0 + m->rows_per_item < m->rows ? r0 + m->rows_per_item : m->rows;
    for (int64_t i = r0; i < r1; i++) {
        const uint8_t *w = m->w + i * m->row_bytes;
        if (m->dotn) {
            for (int r = 0; r < job->R; r += 4)
                m->dotn(m->n, w, m->x + r * m->x_stride, m->x_stride, job->R - r < 4 ? job->R - r : 4,
                        m->out + (int64_t)r * m->rows + i, (size_t)m->rows);
        } else {
            for (int r = 0; r < job->R; r++)
                m->out[(int64_t)r * m->rows + i] = m->dot(m->n, w, m->x + r * m->x_stride);
        }
    }
}

/* Rows of one item for a dequantization: about 16 KB of floats written. */
static int rows_per_item(int64_t row_bytes) {
    int64_t r = 16384 / (row_bytes > 0 ? row_bytes : 1);
    return (int)(r < 16 ? 16 : r > 64 ? 64 : r);
}

/* Weight bytes of one matmul item: 1/8 of a thread's share of the call,
 * at least 64 KB and at most 256 KB.  Items of 16 KB made two threads
 * slower than one on a decode token (84 MB of weights streamed from DRAM
 * in about 5,000 items): every item costs a compare-and-swap and an add on
 * counters that both cores write, and restarts the hardware prefetcher.
 * With 64-256 KB items two threads take a token's products from 7.8 to
 * 4.5-5.1 ms on this 2-core machine; eight items a thread keep the load
 * balanced when one thread is descheduled. */
static int64_t matmul_item_bytes(int64_t total_bytes, int threads) {
    const int64_t share = total_bytes / (8 * (int64_t)threads);
    return share < 65536 ? 65536 : share > 262144 ? 262144 : share;
}

/* matmul(x, R, K, weights, outs, threads): weights is a sequence of
 * (buffer, ggml_type, rows); outs the float32 (R, rows) output buffers. */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    PyObject *xo, *wl, *ol;
    int R, K, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiOOi", &xo, &R, &K, &wl, &ol, &threads)) return NULL;
    if (R < 0 || K <= 0 || threads < 1) return PyErr_Format(PyExc_ValueError, "bad R, K or threads");
    PyObject *wseq = PySequence_Fast(wl, "weights must be a sequence");
    if (!wseq) return NULL;
    PyObject *oseq = PySequence_Fast(ol, "outs must be a sequence");
    if (!oseq) { Py_DECREF(wseq); return NULL; }
    const Py_ssize_t nmat = PySequence_Fast_GET_SIZE(wseq);
    PyObject *result = NULL;
    buf_t xb = {0};
    buf_t *wb = calloc((size_t)nmat + 1, sizeof *wb), *ob = calloc((size_t)nmat + 1, sizeof *ob);
    mm_mat *mats = calloc((size_t)nmat + 1, sizeof *mats);
    enum qk_act *acts = calloc((size_t)nmat + 1, sizeof *acts);
    uint8_t *xa32 = NULL, *xa256 = NULL;
    int need32 = 0, need256 = 0;
    int64_t items = 0, total_bytes = 0;
    if (!wb || !ob || !mats || !acts) { PyErr_NoMemory(); goto done; }
    if (PySequence_Fast_GET_SIZE(oseq) != nmat) {
        PyErr_SetString(PyExc_ValueError, "one output per weight matrix");
        goto done;
    }
    if (get_buf(xo, &xb, 0, (Py_ssize_t)R * K * 4, "x") < 0) goto done;
    for (Py_ssize_t k = 0; k < nmat; k++) {
        PyObject *spec = PySequence_Fast_GET_ITEM(wseq, k), *data;
        int type;
        long long rows;
        if (!PyArg_ParseTuple(spec, "OiL", &data, &type, &rows)) goto done;
        const int bv = type >= 0 && type < QK_NTYPES ? qk_block_values(type) : 0;
        if (!bv || !g_isa.dot[type] || K % bv || rows < 0) {
            PyErr_Format(PyExc_ValueError, "matrix %zd: type %d with K=%d unsupported", k, type, K);
            goto done;
        }
        const int64_t row_bytes = (int64_t)(K / bv) * qk_block_bytes(type);
        if (get_buf(data, &wb[k], 0, (Py_ssize_t)(rows * row_bytes), "weights") < 0) goto done;
        if (get_buf(PySequence_Fast_GET_ITEM(oseq, k), &ob[k], 1, (Py_ssize_t)(R * rows * 4), "out") < 0)
            goto done;
        mm_mat *m = &mats[k];
        m->w = wb[k].view.buf;
        m->out = ob[k].view.buf;
        m->dot = g_isa.dot[type];
        m->dotn = g_isa.dotn[type];
        m->rows = rows;
        m->row_bytes = row_bytes;
        m->n = K / bv;
        total_bytes += rows * row_bytes;
        acts[k] = qk_act_kind(type);
        need32 |= acts[k] == QK_ACT_A32;
        need256 |= acts[k] == QK_ACT_A256;
    }
    const int64_t item_bytes = matmul_item_bytes(total_bytes, threads);
    for (Py_ssize_t k = 0; k < nmat; k++) {
        mm_mat *m = &mats[k];
        const int64_t r = item_bytes / (m->row_bytes > 0 ? m->row_bytes : 1);
        m->rows_per_item = (int)(r < 1 ? 1 : r > m->rows ? (m->rows > 0 ? m->rows : 1) : r);
        m->first_item = items;
        items += (m->rows + m->rows_per_item - 1) / m->rows_per_item;
    }
    const size_t s32 = (size_t)(K / 32) * sizeof(qk_a32), s256 = (size_t)(K / 256) * sizeof(qk_a256);
    if (need32 && !(xa32 = malloc((size_t)R * s32 + 1))) { PyErr_NoMemory(); goto done; }
    if (need256 && !(xa256 = malloc((size_t)R * s256 + 1))) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < nmat; k++) {
        mm_mat *m = &mats[k];
        switch (acts[k]) {
        case QK_ACT_A32: m->x = xa32; m->x_stride = s32; break;
        case QK_ACT_A256: m->x = xa256; m->x_stride = s256; break;
        default: m->x = xb.view.buf; m->x_stride = (size_t)K * 4; break;
        }
    }
    if (R > 0 && items > 0) {
        const float *x = xb.view.buf;
        mm_job job = {mats, (int)nmat, R};
        Py_BEGIN_ALLOW_THREADS
        for (int r = 0; r < R; r++) {
            if (need32) g_isa.quantize_a32(K, x + (int64_t)r * K, (qk_a32 *)(void *)(xa32 + r * s32));
            if (need256) g_isa.quantize_a256(K, x + (int64_t)r * K, (qk_a256 *)(void *)(xa256 + r * s256));
        }
        qk_parallel(threads, items, mm_item, &job);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    rel_buf(&xb);
    for (Py_ssize_t k = 0; k < nmat; k++) { if (wb) rel_buf(&wb[k]); if (ob) rel_buf(&ob[k]); }
    free(wb); free(ob); free(mats); free(acts); free(xa32); free(xa256);
    Py_DECREF(wseq);
    Py_DECREF(oseq);
    return result;
}

/* ------------------------------------------------------ dequantize, take */

typedef struct {
    const uint8_t *w;
    float *out;
    qk_dequant_fn dq;
    const int64_t *ids;     /* NULL: rows first, first + 1, ... */
    int64_t first, nrows, row_bytes, cols;
    int n, rows_per_item;
} dq_job;

static void dq_item(void *ctx, int64_t item) {
    const dq_job *j = ctx;
    const int64_t r0 = item * j->rows_per_item;
    const int64_t r1 = r0 + j->rows_per_item < j->nrows ? r0 + j->rows_per_item : j->nrows;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t src = j->ids ? j->ids[r] : j->first + r;
        j->dq(j->n, j->w + src * j->row_bytes, j->out + r * j->cols);
    }
}

/* dequantize(data, type, rows, cols, first, last, out, threads, ids):
 * rows [first, last) of data, or the rows named by the int64 buffer ids
 * (then first and last are ignored), into the float32 buffer out. */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    PyObject *data, *outo, *idso;
    int type, threads;
    long long rows, cols, first, last;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiLLLLOiO", &data, &type, &rows, &cols, &first, &last, &outo,
                          &threads, &idso))
        return NULL;
    const int bv = type >= 0 && type < QK_NTYPES ? qk_block_values(type) : 0;
    if (!bv || !g_isa.dequant[type] || cols <= 0 || cols % bv || rows < 0 || threads < 1)
        return PyErr_Format(PyExc_ValueError, "type %d with %lld columns unsupported", type, cols);
    const int64_t row_bytes = cols / bv * qk_block_bytes(type);
    buf_t wb = {0}, ob = {0}, ib = {0};
    PyObject *result = NULL;
    dq_job j = {0};
    if (get_buf(data, &wb, 0, (Py_ssize_t)(rows * row_bytes), "weights") < 0) goto done;
    if (idso != Py_None) {
        if (get_buf(idso, &ib, 0, -1, "ids") < 0) goto done;
        j.ids = ib.view.buf;
        j.nrows = ib.view.len / 8;
        for (int64_t i = 0; i < j.nrows; i++)
            if (j.ids[i] < 0 || j.ids[i] >= rows) {
                PyErr_Format(PyExc_IndexError, "row id %lld out of range [0, %lld)",
                             (long long)j.ids[i], rows);
                goto done;
            }
    } else {
        if (first < 0 || last > rows || first > last) {
            PyErr_Format(PyExc_IndexError, "rows [%lld, %lld) out of [0, %lld)", first, last, rows);
            goto done;
        }
        j.first = first;
        j.nrows = last - first;
    }
    if (get_buf(outo, &ob, 1, (Py_ssize_t)(j.nrows * cols * 4), "out") < 0) goto done;
    j.w = wb.view.buf;
    j.out = ob.view.buf;
    j.dq = g_isa.dequant[type];
    j.row_bytes = row_bytes;
    j.cols = cols;
    j.n = (int)(cols / bv);
    j.rows_per_item = rows_per_item(cols * 4);   /* sized by the floats written */
    const int64_t items = (j.nrows + j.rows_per_item - 1) / j.rows_per_item;
    Py_BEGIN_ALLOW_THREADS
    qk_parallel(threads, items, dq_item, &j);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    rel_buf(&wb); rel_buf(&ob); rel_buf(&ib);
    return result;
}

/* ----------------------------------------------------------- ISA choice */

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(g_isa.name);
}

/* select_isa(name): "auto", "scalar", "avx2" or "neon"; returns the name in
 * use, or raises ValueError when this CPU or build cannot run it. */
static PyObject *py_select_isa(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (!strcmp(name, "auto")) isa_auto();
    else if (!strcmp(name, "scalar")) qk_fill_scalar(&g_isa);
#if defined(QK_HAVE_X86)
    else if (!strcmp(name, "avx2") && qk_cpu_has_avx2()) qk_fill_avx2(&g_isa);
#endif
#if defined(QK_HAVE_NEON)
    else if (!strcmp(name, "neon")) qk_fill_neon(&g_isa);
#endif
    else return PyErr_Format(PyExc_ValueError, "instruction set %s is not available here", name);
    return PyUnicode_FromString(g_isa.name);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "matmul(x, R, K, weights, outs, threads)"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(data, type, rows, cols, first, last, out, threads, ids)"},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"select_isa", py_select_isa, METH_VARARGS, "select_isa(name) -> name in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_qk", "Fused quantized matrix products (see pmetal.model.kernels).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__qk(void) {
    isa_auto();
    return PyModule_Create(&moduledef);
}
