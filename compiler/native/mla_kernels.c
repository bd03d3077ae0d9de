/*
 * Compiled kernels of the MLA emulator's hot loops (compiler/native/__init__.py).
 *
 * Each kernel computes exactly what the numpy code it stands in for computes, bit for bit:
 *
 *   output_stage  compiler.intmath.FusedOutputStage._run (acc -> codes, float64 or int64 passes)
 *   depthwise     the int32 accumulators of a depthwise CONV (one input channel and one output
 *                 per group), padding holding the zero point
 *   im2col        centred im2col columns (N, C, kh, kw, rows, wo) of stored codes, in float32 or
 *                 float64, padding holding centred 0
 *
 * Operands are any objects with the buffer protocol (numpy arrays, strided views included);
 * shapes and dtypes are checked here and a mismatch raises ValueError / TypeError. The GIL is
 * released while a kernel computes, so the emulator's threads run kernels side by side.
 *
 * Floating point: every double operation here is exact on the values the callers pass (they
 * prove it before choosing the float path), and the file is compiled with -ffp-contract=off so
 * that no multiply-add is fused into an FMA, which would round differently if it ever were not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANK 8

typedef enum { K_I8, K_U8, K_I16, K_U16, K_I32, K_U32, K_I64, K_U64, K_F32, K_F64, K_BAD } Kind;

typedef struct {
    Py_buffer view;
    Kind kind;
    int held;
} Operand;

static Kind kind_of(const Py_buffer *view) {
    const char *f = view->format ? view->format : "B";
    while (*f == '<' || *f == '=' || *f == '@' || *f == '!' || *f == '>') {
        if (*f == '>' || *f == '!') return K_BAD; /* big-endian data: not ours */
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0') return K_BAD;
    Py_ssize_t size = view->itemsize;
    switch (f[0]) {
    case 'b': return K_I8;
    case 'B': return K_U8;
    case 'h': return K_I16;
    case 'H': return K_U16;
    case 'i': case 'l': case 'q':
        return size == 4 ? K_I32 : size == 8 ? K_I64 : K_BAD;
    case 'I': case 'L': case 'Q':
        return size == 4 ? K_U32 : size == 8 ? K_U64 : K_BAD;
    case 'f': return size == 4 ? K_F32 : K_BAD;
    case 'd': return size == 8 ? K_F64 : K_BAD;
    default: return K_BAD;
    }
}

static int get_operand(PyObject *obj, Operand *op, int writable, const char *name) {
    int flags = PyBUF_RECORDS_RO;
    if (writable) flags = PyBUF_RECORDS;
    op->held = 0;
    if (PyObject_GetBuffer(obj, &op->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: not a %sarray buffer", name, writable ? "writable " : "");
        return -1;
    }
    op->held = 1;
    op->kind = kind_of(&op->view);
    if (op->kind == K_BAD) {
        PyErr_Format(PyExc_TypeError, "%s: unsupported element type '%s'", name,
                     op->view.format ? op->view.format : "?");
        return -1;
    }
    if (op->view.ndim > MAX_RANK) {
        PyErr_Format(PyExc_ValueError, "%s: rank %d is above %d", name, op->view.ndim, MAX_RANK);
        return -1;
    }
    return 0;
}

static void release(Operand *op) {
    if (op->held) PyBuffer_Release(&op->view);
    op->held = 0;
}

static inline double load_f64(const char *p, Kind k) {
    switch (k) {
    case K_I8: return (double)*(const int8_t *)p;
    case K_U8: return (double)*(const uint8_t *)p;
    case K_I16: return (double)*(const int16_t *)p;
    case K_U16: return (double)*(const uint16_t *)p;
    case K_I32: return (double)*(const int32_t *)p;
    case K_U32: return (double)*(const uint32_t *)p;
    case K_I64: return (double)*(const int64_t *)p;
    case K_U64: return (double)*(const uint64_t *)p;
    case K_F32: return (double)*(const float *)p;
    case K_F64: return *(const double *)p;
    default: return 0.0;
    }
}

/* An integer operand value (floats hold integers exactly here: numpy's unsafe cast truncates,
 * which for an integral value is the value). */
static inline int64_t load_i64(const char *p, Kind k) {
    switch (k) {
    case K_I8: return *(const int8_t *)p;
    case K_U8: return *(const uint8_t *)p;
    case K_I16: return *(const int16_t *)p;
    case K_U16: return *(const uint16_t *)p;
    case K_I32: return *(const int32_t *)p;
    case K_U32: return *(const uint32_t *)p;
    case K_I64: return *(const int64_t *)p;
    case K_U64: return (int64_t)*(const uint64_t *)p;
    case K_F32: return (int64_t)*(const float *)p;
    case K_F64: return (int64_t)*(const double *)p;
    default: return 0;
    }
}

/* Store the low bits of an integer code, as numpy's unsafe cast to the code dtype does. */
static inline void store_code(char *p, Kind k, int64_t v) {
    switch (k) {
    case K_I8: *(int8_t *)p = (int8_t)v; break;
    case K_U8: *(uint8_t *)p = (uint8_t)v; break;
    case K_I16: *(int16_t *)p = (int16_t)v; break;
    case K_U16: *(uint16_t *)p = (uint16_t)v; break;
    case K_I32: *(int32_t *)p = (int32_t)v; break;
    case K_U32: *(uint32_t *)p = (uint32_t)v; break;
    case K_I64: *(int64_t *)p = v; break;
    case K_U64: *(uint64_t *)p = (uint64_t)v; break;
    default: break;
    }
}

/* numpy's unsafe cast of a float64 to the code dtype: C's conversion (truncation toward zero)
 * for the in-range values the stage produces. */
static inline void store_code_f64(char *p, Kind k, double v) {
    switch (k) {
    case K_I8: *(int8_t *)p = (int8_t)v; break;
    case K_U8: *(uint8_t *)p = (uint8_t)v; break;
    case K_I16: *(int16_t *)p = (int16_t)v; break;
    case K_U16: *(uint16_t *)p = (uint16_t)v; break;
    case K_I32: *(int32_t *)p = (int32_t)v; break;
    case K_U32: *(uint32_t *)p = (uint32_t)v; break;
    case K_I64: *(int64_t *)p = (int64_t)v; break;
    case K_U64: *(uint64_t *)p = (uint64_t)v; break;
    default: break;
    }
}

/* Strides (in bytes) of `table` broadcast against a result of `shape` (rank `ndim`): numpy's
 * rules, aligned on the trailing axes; -1 if it does not broadcast. */
static int broadcast_strides(const Py_buffer *table, int ndim, const Py_ssize_t *shape,
                             Py_ssize_t *strides) {
    int offset = ndim - table->ndim;
    if (offset < 0) return -1;
    for (int d = 0; d < ndim; d++) {
        if (d < offset) {
            strides[d] = 0;
            continue;
        }
        Py_ssize_t n = table->shape[d - offset];
        if (n == shape[d]) {
            strides[d] = n == 1 ? 0 : table->strides[d - offset];
        } else if (n == 1) {
            strides[d] = 0;
        } else {
            return -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* output_stage                                                                              */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    int ndim;
    Py_ssize_t shape[MAX_RANK];
    const char *acc;
    Py_ssize_t acc_strides[MAX_RANK];
    Kind acc_kind;
    char *out;
    Py_ssize_t out_strides[MAX_RANK];
    Kind out_kind;
    const char *table[5]; /* lower, upper, scale, offset, total_shift */
    Py_ssize_t table_strides[5][MAX_RANK];
    int exact_float;
    double code_low, code_high;
    int64_t excess;
} StageJob;


typedef struct {
    const char *codes;
    Py_ssize_t cs[4]; /* codes strides (bytes) */
    Kind codes_kind;
    Py_ssize_t batch, channels, height, width;
    int64_t zero_point;
    const int32_t *weight; /* (channels, kh, kw) contiguous */
    int kh, kw, sh, sw, dh, dw, top, left, bottom, right;
    int32_t *out; /* (batch, channels, ho, wo) contiguous */
    Py_ssize_t ho, wo;
} DepthwiseJob;

typedef struct {
    const char *codes;
    Py_ssize_t cs[4];
    Kind codes_kind;
    Py_ssize_t batch, channels, height, width;
    int64_t zero_point;
    int kh, kw, sh, sw, dh, dw, top, left;
    Py_ssize_t row0, rows, wo;
    char *out; /* (batch, channels, kh, kw, rows, wo) contiguous, float32 or float64 */
    int doubles;
} ColumnsJob;

typedef struct {
    const char *codes;
    Py_ssize_t cs[4];
    Py_ssize_t batch, channels, height, width;
    int top, left, sh, sw;
    uint8_t flip, pad;
    uint8_t *out; /* (batch, channels, sh, sw, rows, pitch) */
    Py_ssize_t rows, pitch;
} PhaseJob;

/* The inner loops, for the baseline instruction set and (GCC or Clang on x86-64) for AVX2. */
#define HOT(name) name##_base
#include "mla_hot.h"
#undef HOT

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
#define HOT(name) name##_avx2
#include "mla_hot.h"
#undef HOT
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

static int use_avx2 = 0; /* set when the module loads, from what the CPU supports */

static void run_stage(const StageJob *job) {
#ifdef HAVE_AVX2
    if (use_avx2) {
        run_stage_avx2(job);
        return;
    }
#endif
    run_stage_base(job);
}

static int run_depthwise(const DepthwiseJob *job) {
#ifdef HAVE_AVX2
    if (use_avx2) return run_depthwise_avx2(job);
#endif
    return run_depthwise_base(job);
}

static int run_phase_planes(const PhaseJob *job) {
#ifdef HAVE_AVX2
    if (use_avx2) return run_phase_planes_avx2(job);
#endif
    return run_phase_planes_base(job);
}

static void run_im2col(const ColumnsJob *job) {
#ifdef HAVE_AVX2
    if (use_avx2) {
        run_im2col_avx2(job);
        return;
    }
#endif
    run_im2col_base(job);
}

/* The dimensions of a stage job reordered so that the innermost is the one acc walks with the
 * smallest stride (where the contiguous loops apply), unit dimensions dropped and neighbours
 * that every operand walks as one merged (long rows instead of many short ones). */
static void order_stage_dims(StageJob *job) {
    int order[MAX_RANK], kept = 0;
    for (int d = 0; d < job->ndim; d++)
        if (job->shape[d] != 1) order[kept++] = d;
    /* insertion sort, largest |acc stride| first, stable */
    for (int i = 1; i < kept; i++) {
        int d = order[i], k = i;
        Py_ssize_t sd = job->acc_strides[d] < 0 ? -job->acc_strides[d] : job->acc_strides[d];
        while (k > 0) {
            int e = order[k - 1];
            Py_ssize_t se = job->acc_strides[e] < 0 ? -job->acc_strides[e] : job->acc_strides[e];
            if (se >= sd) break;
            order[k] = e;
            k--;
        }
        order[k] = d;
    }
    StageJob copy = *job;
    if (kept == 0) { /* a single element */
        job->ndim = 1;
        job->shape[0] = 1;
        return;
    }
    /* ... and a dimension merged into the next where every operand walks both as one */
    int ndim = 0;
    for (int i = 0; i < kept; i++) {
        int d = order[i];
        if (ndim > 0) {
            int p = ndim - 1;
            Py_ssize_t n = copy.shape[d];
            int joins = job->acc_strides[p] == n * copy.acc_strides[d] &&
                        job->out_strides[p] == n * copy.out_strides[d];
            for (int t = 0; t < 5 && joins; t++)
                joins = job->table_strides[t][p] == n * copy.table_strides[t][d];
            if (joins) {
                job->shape[p] *= n;
                job->acc_strides[p] = copy.acc_strides[d];
                job->out_strides[p] = copy.out_strides[d];
                for (int t = 0; t < 5; t++) job->table_strides[t][p] = copy.table_strides[t][d];
                continue;
            }
        }
        job->shape[ndim] = copy.shape[d];
        job->acc_strides[ndim] = copy.acc_strides[d];
        job->out_strides[ndim] = copy.out_strides[d];
        for (int t = 0; t < 5; t++) job->table_strides[t][ndim] = copy.table_strides[t][d];
        ndim++;
    }
    job->ndim = ndim;
}

static PyObject *output_stage(PyObject *self, PyObject *args) {
    PyObject *acc_obj, *out_obj, *table_obj[5];
    int exact_float;
    double code_low, code_high;
    long long excess;
    if (!PyArg_ParseTuple(args, "OOOOOOOpddL", &acc_obj, &out_obj, &table_obj[0], &table_obj[1],
                          &table_obj[2], &table_obj[3], &table_obj[4], &exact_float, &code_low,
                          &code_high, &excess))
        return NULL;
    Operand acc, out, tables[5];
    memset(tables, 0, sizeof(tables));
    acc.held = out.held = 0;
    PyObject *result = NULL;
    StageJob job;
    static const char *names[5] = {"lower", "upper", "scale", "offset", "total_shift"};
    if (get_operand(acc_obj, &acc, 0, "acc") < 0 || get_operand(out_obj, &out, 1, "out") < 0)
        goto done;
    for (int t = 0; t < 5; t++)
        if (get_operand(table_obj[t], &tables[t], 0, names[t]) < 0) goto done;
    if (acc.view.ndim != out.view.ndim || acc.view.ndim == 0) {
        PyErr_SetString(PyExc_ValueError, "acc and out must have the same (non-zero) rank");
        goto done;
    }
    for (int d = 0; d < acc.view.ndim; d++)
        if (acc.view.shape[d] != out.view.shape[d]) {
            PyErr_SetString(PyExc_ValueError, "acc and out must have the same shape");
            goto done;
        }
    if (out.kind == K_F32 || out.kind == K_F64) {
        PyErr_SetString(PyExc_TypeError, "out must hold integer codes");
        goto done;
    }
    job.ndim = acc.view.ndim;
    for (int d = 0; d < job.ndim; d++) {
        job.shape[d] = acc.view.shape[d];
        job.acc_strides[d] = acc.view.strides[d];
        job.out_strides[d] = out.view.strides[d];
    }
    job.acc = acc.view.buf;
    job.acc_kind = acc.kind;
    job.out = out.view.buf;
    job.out_kind = out.kind;
    for (int t = 0; t < 5; t++) {
        Kind want = (exact_float && (t == 2 || t == 3)) ? K_F64 : K_I64;
        if (exact_float && t != 2 && t != 3) want = tables[t].kind; /* unused by the float path */
        if (tables[t].kind != want) {
            PyErr_Format(PyExc_TypeError, "%s must be %s", names[t],
                         want == K_F64 ? "float64" : "int64");
            goto done;
        }
        if (broadcast_strides(&tables[t].view, job.ndim, job.shape, job.table_strides[t]) < 0) {
            PyErr_Format(PyExc_ValueError, "%s does not broadcast to acc", names[t]);
            goto done;
        }
        job.table[t] = tables[t].view.buf;
    }
    job.exact_float = exact_float;
    job.code_low = code_low;
    job.code_high = code_high;
    job.excess = (int64_t)excess;
    order_stage_dims(&job);
    Py_BEGIN_ALLOW_THREADS
    run_stage(&job);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&acc);
    release(&out);
    for (int t = 0; t < 5; t++) release(&tables[t]);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* depthwise                                                                                 */
/* ---------------------------------------------------------------------------------------- */


static int check_int_codes(const Operand *op, const char *name) {
    if (op->kind == K_F32 || op->kind == K_F64 || op->kind == K_I64 || op->kind == K_U64 ||
        op->kind == K_U32) {
        PyErr_Format(PyExc_TypeError, "%s must hold 8-, 16- or 32-bit integer codes", name);
        return -1;
    }
    return 0;
}

static PyObject *depthwise(PyObject *self, PyObject *args) {
    PyObject *codes_obj, *weight_obj, *out_obj;
    long long zero_point;
    int top, left, bottom, right, sh, sw, dh, dw;
    if (!PyArg_ParseTuple(args, "OLO(iiii)(ii)(ii)O", &codes_obj, &zero_point, &weight_obj, &top,
                          &left, &bottom, &right, &sh, &sw, &dh, &dw, &out_obj))
        return NULL;
    Operand codes, weight, out;
    codes.held = weight.held = out.held = 0;
    PyObject *result = NULL;
    DepthwiseJob job;
    int failed = 0;
    if (get_operand(codes_obj, &codes, 0, "codes") < 0 ||
        get_operand(weight_obj, &weight, 0, "weight") < 0 ||
        get_operand(out_obj, &out, 1, "out") < 0)
        goto done;
    if (check_int_codes(&codes, "codes") < 0) goto done;
    if (codes.view.ndim != 4 || weight.view.ndim != 3 || out.view.ndim != 4) {
        PyErr_SetString(PyExc_ValueError, "codes (N, C, H, W), weight (C, kh, kw), out 4-D");
        goto done;
    }
    if (weight.kind != K_I32 || !PyBuffer_IsContiguous(&weight.view, 'C') || out.kind != K_I32 ||
        !PyBuffer_IsContiguous(&out.view, 'C')) {
        PyErr_SetString(PyExc_TypeError, "weight and out must be C-contiguous int32");
        goto done;
    }
    if (sh < 1 || sw < 1 || dh < 1 || dw < 1 || top < 0 || left < 0 || bottom < 0 || right < 0) {
        PyErr_SetString(PyExc_ValueError, "strides and dilations >= 1, pads >= 0");
        goto done;
    }
    job.codes = codes.view.buf;
    for (int d = 0; d < 4; d++) job.cs[d] = codes.view.strides[d];
    job.codes_kind = codes.kind;
    job.batch = codes.view.shape[0];
    job.channels = codes.view.shape[1];
    job.height = codes.view.shape[2];
    job.width = codes.view.shape[3];
    job.zero_point = zero_point;
    job.weight = weight.view.buf;
    job.kh = (int)weight.view.shape[1];
    job.kw = (int)weight.view.shape[2];
    job.sh = sh, job.sw = sw, job.dh = dh, job.dw = dw;
    job.top = top, job.left = left, job.bottom = bottom, job.right = right;
    job.out = out.view.buf;
    Py_ssize_t ph = job.height + top + bottom, pw = job.width + left + right;
    Py_ssize_t eh = (Py_ssize_t)(job.kh - 1) * dh + 1, ew = (Py_ssize_t)(job.kw - 1) * dw + 1;
    job.ho = ph >= eh ? (ph - eh) / sh + 1 : 0;
    job.wo = pw >= ew ? (pw - ew) / sw + 1 : 0;
    if (weight.view.shape[0] != job.channels || out.view.shape[0] != job.batch ||
        out.view.shape[1] != job.channels || out.view.shape[2] != job.ho ||
        out.view.shape[3] != job.wo) {
        PyErr_SetString(PyExc_ValueError, "depthwise: shapes of codes, weight and out disagree");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    failed = run_depthwise(&job);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&codes);
    release(&weight);
    release(&out);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* im2col                                                                                    */
/* ---------------------------------------------------------------------------------------- */


static PyObject *im2col(PyObject *self, PyObject *args) {
    PyObject *codes_obj, *out_obj;
    long long zero_point;
    int kh, kw, top, left, bottom, right, sh, sw, dh, dw;
    Py_ssize_t row0;
    if (!PyArg_ParseTuple(args, "OL(ii)(iiii)(ii)(ii)nO", &codes_obj, &zero_point, &kh, &kw, &top,
                          &left, &bottom, &right, &sh, &sw, &dh, &dw, &row0, &out_obj))
        return NULL;
    Operand codes, out;
    codes.held = out.held = 0;
    PyObject *result = NULL;
    ColumnsJob job;
    if (get_operand(codes_obj, &codes, 0, "codes") < 0 || get_operand(out_obj, &out, 1, "out") < 0)
        goto done;
    if (check_int_codes(&codes, "codes") < 0) goto done;
    if (codes.view.ndim != 4 || out.view.ndim != 6 || !PyBuffer_IsContiguous(&out.view, 'C') ||
        (out.kind != K_F32 && out.kind != K_F64)) {
        PyErr_SetString(PyExc_ValueError,
                        "codes (N, C, H, W); out C-contiguous float (N, C, kh, kw, rows, wo)");
        goto done;
    }
    if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || dh < 1 || dw < 1 || top < 0 || left < 0 ||
        bottom < 0 || right < 0 || row0 < 0) {
        PyErr_SetString(PyExc_ValueError, "im2col: bad kernel, strides, dilations or pads");
        goto done;
    }
    job.codes = codes.view.buf;
    for (int d = 0; d < 4; d++) job.cs[d] = codes.view.strides[d];
    job.codes_kind = codes.kind;
    job.batch = codes.view.shape[0];
    job.channels = codes.view.shape[1];
    job.height = codes.view.shape[2];
    job.width = codes.view.shape[3];
    job.zero_point = zero_point;
    job.kh = kh, job.kw = kw, job.sh = sh, job.sw = sw, job.dh = dh, job.dw = dw;
    job.top = top, job.left = left;
    job.row0 = row0;
    job.rows = out.view.shape[4];
    job.wo = out.view.shape[5];
    job.out = out.view.buf;
    job.doubles = out.kind == K_F64;
    Py_ssize_t ph = job.height + top + bottom, pw = job.width + left + right;
    Py_ssize_t eh = (Py_ssize_t)(kh - 1) * dh + 1, ew = (Py_ssize_t)(kw - 1) * dw + 1;
    Py_ssize_t ho = ph >= eh ? (ph - eh) / sh + 1 : 0;
    Py_ssize_t wo = pw >= ew ? (pw - ew) / sw + 1 : 0;
    if (out.view.shape[0] != job.batch || out.view.shape[1] != job.channels ||
        out.view.shape[2] != kh || out.view.shape[3] != kw || job.wo != wo ||
        row0 + job.rows > ho) {
        PyErr_SetString(PyExc_ValueError, "im2col: out does not match the codes and geometry");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    run_im2col(&job);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&codes);
    release(&out);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* int8 CONV on the CPU's int8 dot products (AVX-512 VNNI): mla_vnni.h                       */
/* ---------------------------------------------------------------------------------------- */

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_VNNI 1
#include "mla_vnni.h"
#endif

static int have_vnni = 0; /* set when the module loads */

/* The arguments both plane kernels share: the planes buffer and its (N, C, phases, PH, PW)
 * shape, the taps' phases and offsets, weights and corrections, and out; checked here. */
typedef struct {
    Operand planes, tap_phase, tap_offset, weights, corrections, out, tables[5];
} PlaneOperands;

static void release_planes(PlaneOperands *ops) {
    for (int t = 0; t < 5; t++) release(&ops->tables[t]);
    release(&ops->planes);
    release(&ops->tap_phase);
    release(&ops->tap_offset);
    release(&ops->weights);
    release(&ops->corrections);
    release(&ops->out);
}

static int plane_operands(PyObject *const objs[6], const Py_ssize_t shape[5], int flip,
                          PyObject *stage, PlaneOperands *ops, PlaneJob *job, int weight_rank) {
    static const char *names[6] = {"planes", "tap_phase", "tap_offset", "weights", "corrections",
                                   "out"};
    Operand *all[6] = {&ops->planes, &ops->tap_phase, &ops->tap_offset, &ops->weights,
                       &ops->corrections, &ops->out};
    for (int i = 0; i < 6; i++) all[i]->held = 0;
    for (int t = 0; t < 5; t++) ops->tables[t].held = 0;
    if (!have_vnni) {
        PyErr_SetString(PyExc_RuntimeError, "the int8 CONV kernels need AVX-512 VNNI");
        return -1;
    }
    for (int i = 0; i < 6; i++)
        if (get_operand(objs[i], all[i], i == 5, names[i]) < 0) return -1;
    for (int i = 0; i < 6; i++)
        if (!PyBuffer_IsContiguous(&all[i]->view, 'C') && !(i == 5 && stage != Py_None)) {
            PyErr_Format(PyExc_ValueError, "%s must be C-contiguous", names[i]);
            return -1;
        }
    if (ops->planes.kind != K_U8 || ops->tap_phase.kind != K_I32 || ops->tap_offset.kind != K_I64 ||
        ops->weights.kind != K_I32 || ops->corrections.kind != K_I32) {
        PyErr_SetString(PyExc_TypeError,
                        "planes uint8, tap_phase int32, tap_offset int64, weights and "
                        "corrections int32");
        return -1;
    }
    for (int d = 0; d < 5; d++)
        if (shape[d] < 1) {
            PyErr_SetString(PyExc_ValueError, "the planes' shape must be positive");
            return -1;
        }
    Py_ssize_t taps = ops->tap_phase.view.len / 4;
    if (ops->tap_offset.view.len / 8 != taps || taps < 1 || ops->weights.view.ndim != weight_rank) {
        PyErr_SetString(PyExc_ValueError, "one phase and one offset per tap");
        return -1;
    }
    const int32_t *phase = ops->tap_phase.view.buf;
    const Py_ssize_t *offset = ops->tap_offset.view.buf;
    Py_ssize_t plane = shape[3] * shape[4], largest = 0;
    for (Py_ssize_t t = 0; t < taps; t++) {
        if (phase[t] < 0 || phase[t] >= shape[2] || offset[t] < 0 || offset[t] >= plane) {
            PyErr_SetString(PyExc_ValueError, "a tap's phase or offset is outside its planes");
            return -1;
        }
        if (offset[t] > largest) largest = offset[t];
    }
    if (ops->planes.view.len != shape[0] * shape[1] * shape[2] * plane) {
        PyErr_SetString(PyExc_ValueError, "planes must hold (N, C, phases, PH, PW) bytes");
        return -1;
    }
    if (flip != 0 && flip != 0x80) {
        PyErr_SetString(PyExc_ValueError, "flip must be 0 (uint8 codes) or 128 (int8 codes)");
        return -1;
    }
    job->largest_offset = largest;
    job->flip = (uint8_t)flip;
    job->planes = ops->planes.view.buf;
    job->batch = shape[0], job->channels = shape[1], job->phases = shape[2];
    job->ph = shape[3], job->pw = shape[4];
    job->tap_phase = phase;
    job->tap_offset = offset;
    job->taps = taps;
    job->weights = ops->weights.view.buf;
    job->corrections = ops->corrections.view.buf;
    job->out = NULL;
    job->codes = NULL;
    const Py_buffer *out = &ops->out.view;
    job->out_channels = out->ndim >= 2 ? out->shape[1] : 0;
    if (stage == Py_None) {
        if (ops->out.kind != K_I32 || out->ndim != 3 || out->shape[2] < 1) {
            PyErr_SetString(PyExc_TypeError,
                            "out must be (N, M, positions) int32 accumulators without a stage");
            return -1;
        }
        job->out = out->buf;
        job->positions = out->shape[2];
        job->code_width = 0;
        return 0;
    }
    /* (a dimension of one element may have any stride: numpy does not normalise them) */
    if (out->ndim != 4 || (out->shape[3] > 1 && out->strides[3] != out->itemsize) ||
        out->shape[2] < 1 || out->shape[3] < 1 || out->shape[3] > job->pw) {
        PyErr_SetString(PyExc_ValueError,
                        "out must be the (N, M, rows, width) codes, rows contiguous, with a stage");
        return -1;
    }
    for (int d = 0; d < 3; d++) job->code_strides[d] = out->strides[d];
    job->code_width = out->shape[3];
    job->rows_packed = out->shape[2] == 1 || out->strides[2] == out->shape[3] * out->itemsize;
    job->codes_flat = job->rows_packed && job->code_width == job->pw;
    job->positions = (out->shape[2] - 1) * job->pw + out->shape[3];
    /* the fused stage, its tables one entry per output channel: (scale, offset, code_low,
     * code_high, excess) for the float64 path, (lower, upper, multiplier, offset, shift,
     * excess) for the int64 one; out of the codes' dtype */
    if (ops->out.kind != K_U8 && ops->out.kind != K_U16) {
        PyErr_SetString(PyExc_TypeError, "out must hold uint8 or uint16 codes with a stage");
        return -1;
    }
    if (!PyTuple_Check(stage) || (PyTuple_GET_SIZE(stage) != 5 && PyTuple_GET_SIZE(stage) != 6)) {
        PyErr_SetString(PyExc_TypeError, "stage: a tuple of 5 (float64 path) or 6 (int64) items");
        return -1;
    }
    job->stage_int = PyTuple_GET_SIZE(stage) == 6;
    int count = job->stage_int ? 5 : 2;
    long excess;
    static const char *table_names[5] = {"stage table 0", "stage table 1", "stage table 2",
                                         "stage table 3", "stage table 4"};
    PyObject *objs_t[5];
    if (job->stage_int) {
        if (!PyArg_ParseTuple(stage, "OOOOOl", &objs_t[0], &objs_t[1], &objs_t[2], &objs_t[3],
                              &objs_t[4], &excess))
            return -1;
    } else if (!PyArg_ParseTuple(stage, "OOddl", &objs_t[0], &objs_t[1], &job->code_low,
                                 &job->code_high, &excess)) {
        return -1;
    }
    Py_ssize_t channels = ops->out.view.shape[1];
    job->n_scale = -1;
    for (int t = 0; t < count; t++) {
        if (get_operand(objs_t[t], &ops->tables[t], 0, table_names[t]) < 0) return -1;
        const Py_buffer *v = &ops->tables[t].view;
        Kind want = job->stage_int ? K_I64 : K_F64;
        if (ops->tables[t].kind != want || !PyBuffer_IsContiguous(v, 'C') || v->ndim != 1 ||
            v->shape[0] < channels || (job->n_scale >= 0 && v->shape[0] != job->n_scale)) {
            PyErr_SetString(PyExc_ValueError,
                            "stage tables: one float64 (float path) or int64 (int path) per "
                            "output channel each");
            return -1;
        }
        job->n_scale = v->shape[0];
        job->tables[t] = v->buf;
    }
    job->excess = (int32_t)excess;
    job->code_bytes = ops->out.kind == K_U8 ? 1 : 2;
    job->codes = ops->out.view.buf;
    return 0;
}

static PyObject *conv_planes(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    Py_ssize_t shape[5], row0;
    int group;
    int flip;
    PyObject *stage = Py_None;
    if (!PyArg_ParseTuple(args, "O(nnnnn)iOOOOinO|O", &objs[0], &shape[0], &shape[1], &shape[2],
                          &shape[3], &shape[4], &flip, &objs[1], &objs[2], &objs[3], &objs[4],
                          &group, &row0, &objs[5], &stage))
        return NULL;
    PlaneOperands ops;
    PlaneJob job;
    PyObject *result = NULL;
    int failed = 0;
    if (plane_operands(objs, shape, flip, stage, &ops, &job, 3) < 0) goto done;
    const Py_buffer *w = &ops.weights.view, *c = &ops.corrections.view, *o = &ops.out.view;
    /* the last position read: row0's start plus the positions, plus the largest tap offset */
    if (group < 1 || job.channels % group || w->shape[0] != group || c->ndim != 2 ||
        c->shape[0] != group || c->shape[1] != w->shape[1] || o->shape[0] != job.batch ||
        o->shape[1] != group * w->shape[1] || row0 < 0 ||
        row0 * job.pw + job.positions + job.largest_offset > job.ph * job.pw ||
        (job.codes != NULL && job.n_scale < group * w->shape[1])) {
        PyErr_SetString(PyExc_ValueError,
                        "conv_planes: shapes of planes, weights, corrections and out disagree");
        goto done;
    }
    job.group = group;
    job.mg = (int)w->shape[1];
    job.cg = (int)(job.channels / group);
    job.k = job.cg * job.taps;
    job.k4 = w->shape[2];
    job.row0 = row0;
    if (job.k4 != (job.k + 3) / 4) {
        PyErr_SetString(PyExc_ValueError, "weights: one int32 per four of (C/G) * taps");
        goto done;
    }
#ifdef HAVE_VNNI
    Py_BEGIN_ALLOW_THREADS
    failed = run_conv_planes(&job);
    Py_END_ALLOW_THREADS
#endif
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_planes(&ops);
    return result;
}

static PyObject *depthwise_planes(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    Py_ssize_t shape[5], channel0;
    int flip;
    PyObject *stage = Py_None;
    if (!PyArg_ParseTuple(args, "O(nnnnn)iOOOOnO|O", &objs[0], &shape[0], &shape[1], &shape[2],
                          &shape[3], &shape[4], &flip, &objs[1], &objs[2], &objs[3], &objs[4],
                          &channel0, &objs[5], &stage))
        return NULL;
    PlaneOperands ops;
    PlaneJob job;
    PyObject *result = NULL;
    if (plane_operands(objs, shape, flip, stage, &ops, &job, 2) < 0) goto done;
    const Py_buffer *w = &ops.weights.view, *c = &ops.corrections.view, *o = &ops.out.view;
    job.k = job.taps;
    job.k4 = w->shape[1];
    job.channel0 = channel0;
    job.row0 = 0;
    if (job.taps > 64 || w->shape[0] != job.channels || job.k4 != (job.taps + 3) / 4 ||
        c->ndim != 1 || c->shape[0] != job.channels || o->shape[0] != job.batch ||
        job.positions + job.largest_offset > job.ph * job.pw ||
        channel0 < 0 || channel0 + job.out_channels > job.channels ||
        (job.codes != NULL && job.n_scale < job.channels)) {
        PyErr_SetString(PyExc_ValueError,
                        "depthwise_planes: shapes of planes, weights, corrections and out "
                        "disagree (at most 64 taps)");
        goto done;
    }
    int failed = 0;
#ifdef HAVE_VNNI
    Py_BEGIN_ALLOW_THREADS
    failed = run_depthwise_planes(&job);
    Py_END_ALLOW_THREADS
#endif
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_planes(&ops);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* table lookups                                                                             */
/* ---------------------------------------------------------------------------------------- */

/* out[i] = table[first[i]] or table[first[i] * 256 + second[i]]: an elementwise function of
 * 8-bit codes evaluated once per code (pair) and gathered (compiler/runtime/emulator_ops.py
 * `_gather`). */
#define LOOKUP(NAME, T)                                                                          \
    static void NAME(const T *restrict table, const uint8_t *restrict first,                    \
                     const uint8_t *restrict second, T *restrict out, Py_ssize_t n) {           \
        if (second == NULL) {                                                                   \
            for (Py_ssize_t i = 0; i < n; i++) out[i] = table[first[i]];                        \
            return;                                                                             \
        }                                                                                       \
        for (Py_ssize_t i = 0; i < n; i++)                                                      \
            out[i] = table[((unsigned)first[i] << 8) | second[i]];                              \
    }

LOOKUP(lookup_1, uint8_t)
LOOKUP(lookup_2, uint16_t)
LOOKUP(lookup_4, uint32_t)
LOOKUP(lookup_8, uint64_t)

static PyObject *lookup(PyObject *self, PyObject *args) {
    PyObject *table_obj, *first_obj, *second_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &table_obj, &first_obj, &second_obj, &out_obj))
        return NULL;
    Operand table, first, second, out;
    table.held = first.held = second.held = out.held = 0;
    PyObject *result = NULL;
    int pair = second_obj != Py_None;
    if (get_operand(table_obj, &table, 0, "table") < 0 ||
        get_operand(first_obj, &first, 0, "first") < 0 ||
        (pair && get_operand(second_obj, &second, 0, "second") < 0) ||
        get_operand(out_obj, &out, 1, "out") < 0)
        goto done;
    Py_ssize_t item = table.view.itemsize, n = out.view.len / (out.view.itemsize ? out.view.itemsize : 1);
    int ok = PyBuffer_IsContiguous(&table.view, 'C') && PyBuffer_IsContiguous(&first.view, 'C') &&
             PyBuffer_IsContiguous(&out.view, 'C') && first.view.itemsize == 1 &&
             out.view.itemsize == item && first.view.len == n &&
             table.view.len / item >= (pair ? 65536 : 256) && (item == 1 || item == 2 || item == 4 || item == 8);
    if (pair)
        ok = ok && PyBuffer_IsContiguous(&second.view, 'C') && second.view.itemsize == 1 &&
             second.view.len == n;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError,
                        "lookup: contiguous codes of one byte, out of the table's item size and "
                        "their length, a table of every code (pair)");
        goto done;
    }
    const uint8_t *a = first.view.buf, *b = pair ? second.view.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    switch (item) {
    case 1: lookup_1(table.view.buf, a, b, out.view.buf, n); break;
    case 2: lookup_2(table.view.buf, a, b, out.view.buf, n); break;
    case 4: lookup_4(table.view.buf, a, b, out.view.buf, n); break;
    default: lookup_8(table.view.buf, a, b, out.view.buf, n); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&table);
    release(&first);
    release(&second);
    release(&out);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* phase planes                                                                              */
/* ---------------------------------------------------------------------------------------- */

static PyObject *phase_planes(PyObject *self, PyObject *args) {
    PyObject *codes_obj, *out_obj;
    int top, left, sh, sw, flip, pad;
    Py_ssize_t rows, pitch;
    if (!PyArg_ParseTuple(args, "O(ii)(ii)ii(nn)O", &codes_obj, &top, &left, &sh, &sw, &flip,
                          &pad, &rows, &pitch, &out_obj))
        return NULL;
    Operand codes, out;
    codes.held = out.held = 0;
    PyObject *result = NULL;
    if (get_operand(codes_obj, &codes, 0, "codes") < 0 || get_operand(out_obj, &out, 1, "out") < 0)
        goto done;
    if (codes.view.ndim != 4 || (codes.kind != K_I8 && codes.kind != K_U8) || out.kind != K_U8 ||
        !PyBuffer_IsContiguous(&out.view, 'C')) {
        PyErr_SetString(PyExc_TypeError, "codes (N, C, H, W) int8 or uint8; out contiguous uint8");
        goto done;
    }
    Py_ssize_t batch = codes.view.shape[0], channels = codes.view.shape[1];
    if (sh < 1 || sw < 1 || top < 0 || left < 0 || rows < 0 || pitch < 0 ||
        out.view.len < batch * channels * sh * sw * rows * pitch) {
        PyErr_SetString(PyExc_ValueError, "phase_planes: bad strides, pads or out size");
        goto done;
    }
    PhaseJob job = {codes.view.buf, {0}, batch, channels, codes.view.shape[2],
                    codes.view.shape[3], top, left, sh, sw, (uint8_t)flip, (uint8_t)pad,
                    out.view.buf, rows, pitch};
    for (int d = 0; d < 4; d++) job.cs[d] = codes.view.strides[d];
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = run_phase_planes(&job);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release(&codes);
    release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"output_stage", output_stage, METH_VARARGS,
     "output_stage(acc, out, lower, upper, scale, offset, total_shift, exact_float, code_low, "
     "code_high, excess): FusedOutputStage's passes from acc into the codes out."},
    {"depthwise", depthwise, METH_VARARGS,
     "depthwise(codes, zero_point, weight, pads, strides, dilations, out): int32 accumulators "
     "of a depthwise CONV (one input channel and one output per group)."},
    {"im2col", im2col, METH_VARARGS,
     "im2col(codes, zero_point, kernel, pads, strides, dilations, row0, out): centred im2col "
     "columns of output rows row0 .. row0 + rows of a CONV."},
    {"lookup", lookup, METH_VARARGS,
     "lookup(table, first, second, out): out[i] = table[first[i]], or with second "
     "table[first[i] * 256 + second[i]] (one-byte codes; second may be None)."},
    {"phase_planes", phase_planes, METH_VARARGS,
     "phase_planes(codes, (top, left), (sh, sw), flip, pad, (rows, pitch), out): the padded "
     "stride phases of the codes (code ^ flip) that conv_planes and depthwise_planes read."},
    {"conv_planes", conv_planes, METH_VARARGS,
     "conv_planes(planes, (N, C, phases, PH, PW), flip, tap_phase, tap_offset, weights, "
     "corrections, group, row0, out[, stage]): int32 accumulators of an int8 CONV over its "
     "phase planes (N, M, positions: every column of the pitch PW from output row row0 on); "
     "with stage = (scale, offset, code_low, code_high, excess) or (lower, upper, multiplier, "
     "offset, shift, excess) its output stage's codes (float64 or int64 path) into out, "
     "(N, M, rows, width) with contiguous rows (where `vnni` is True; mla_vnni.h)."},
    {"depthwise_planes", depthwise_planes, METH_VARARGS,
     "depthwise_planes(planes, (N, C, phases, PH, PW), flip, tap_phase, tap_offset, weights, "
     "corrections, channel0, out[, stage]): int32 accumulators (or codes, as conv_planes) of "
     "an int8 depthwise CONV over its phase planes, channels channel0 .. (where `vnni` is True; "
     "mla_vnni.h)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mla_kernels",
    "Compiled kernels of the MLA emulator (bit-identical to its numpy code).", -1, methods,
};

PyMODINIT_FUNC PyInit__mla_kernels(void) {
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
#ifdef HAVE_VNNI
    have_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
    have_vbmi2 = have_vnni && __builtin_cpu_supports("avx512vbmi2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL &&
        (PyModule_AddStringConstant(m, "instruction_set", use_avx2 ? "avx2" : "baseline") < 0 ||
         PyModule_AddIntConstant(m, "vnni", have_vnni) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
