/*
 * The kernels' inner loops, included twice by mla_kernels.c: once for the baseline instruction
 * set and once for AVX2 (each function named HOT(name), i.e. name_base / name_avx2), the one to
 * run chosen when the module loads. Plain C that the compiler vectorises; nothing here touches
 * Python objects (these run without the GIL).
 */

/* ---- output stage ------------------------------------------------------------------------ */

/* One row of the float64 stage, contiguous acc and codes, scale and offset either one value
 * for the row (stride 0) or one per element (stride 1):
 * codes = (code type) clip(acc * scale + offset, low, high) ^ excess. */
#define FLOAT_ROW(NAME, AT, OT)                                                                 \
    static void HOT(NAME)(const AT *restrict a, OT *restrict o, const double *restrict s,      \
                          const double *restrict f, int per_element, double low, double high,  \
                          OT x, Py_ssize_t n) {                                                 \
        if (!per_element) {                                                                     \
            const double s0 = s[0], f0 = f[0];                                                  \
            for (Py_ssize_t k = 0; k < n; k++) {                                                \
                double v = (double)a[k] * s0;                                                   \
                v = v + f0;                                                                     \
                v = v < low ? low : v;                                                          \
                v = v > high ? high : v;                                                        \
                o[k] = (OT)((OT)v ^ x);                                                         \
            }                                                                                   \
            return;                                                                             \
        }                                                                                       \
        for (Py_ssize_t k = 0; k < n; k++) {                                                    \
            double v = (double)a[k] * s[k];                                                     \
            v = v + f[k];                                                                       \
            v = v < low ? low : v;                                                              \
            v = v > high ? high : v;                                                            \
            o[k] = (OT)((OT)v ^ x);                                                             \
        }                                                                                       \
    }

FLOAT_ROW(float_row_f32_u8, float, uint8_t)
FLOAT_ROW(float_row_f64_u8, double, uint8_t)
FLOAT_ROW(float_row_i32_u8, int32_t, uint8_t)
FLOAT_ROW(float_row_f32_u16, float, uint16_t)
FLOAT_ROW(float_row_f64_u16, double, uint16_t)
FLOAT_ROW(float_row_i32_u16, int32_t, uint16_t)

/* The float64 stage of one row with any strides and types. */
static void HOT(float_row_strided)(const StageJob *job, const char *acc, char *out,
                                   const char *scale, const char *offset, Py_ssize_t n) {
    int last = job->ndim - 1;
    Py_ssize_t sa = job->acc_strides[last], so = job->out_strides[last];
    Py_ssize_t ss = job->table_strides[2][last], sf = job->table_strides[3][last];
    double low = job->code_low, high = job->code_high;
    for (Py_ssize_t k = 0; k < n; k++) {
        double v = load_f64(acc + k * sa, job->acc_kind) * *(const double *)(scale + k * ss);
        v = v + *(const double *)(offset + k * sf);
        v = v < low ? low : v;
        v = v > high ? high : v;
        char *p = out + k * so;
        store_code_f64(p, job->out_kind, v);
        if (job->excess) store_code(p, job->out_kind, load_i64(p, job->out_kind) ^ job->excess);
    }
}

/* One row of the float64 stage: a contiguous loop where the operands allow, else strided. */
static void HOT(float_row)(const StageJob *job, const char *acc, char *out, const char *scale,
                           const char *offset, Py_ssize_t n) {
    int last = job->ndim - 1;
    Py_ssize_t sa = job->acc_strides[last], so = job->out_strides[last];
    Py_ssize_t ss = job->table_strides[2][last], sf = job->table_strides[3][last];
    int scalar = ss == 0 && sf == 0;
    int per_element = ss == (Py_ssize_t)sizeof(double) && sf == (Py_ssize_t)sizeof(double);
    Py_ssize_t out_size = job->out_kind == K_U8 ? 1 : job->out_kind == K_U16 ? 2 : 0;
    Py_ssize_t acc_size = job->acc_kind == K_F64 ? 8 : (job->acc_kind == K_F32 || job->acc_kind == K_I32) ? 4 : 0;
    if ((scalar || per_element) && out_size && so == out_size && acc_size && sa == acc_size) {
        const double *s = (const double *)scale, *f = (const double *)offset;
        double low = job->code_low, high = job->code_high;
        if (out_size == 1) {
            uint8_t x = (uint8_t)job->excess;
            uint8_t *o = (uint8_t *)out;
            if (job->acc_kind == K_F32)
                HOT(float_row_f32_u8)((const float *)acc, o, s, f, per_element, low, high, x, n);
            else if (job->acc_kind == K_F64)
                HOT(float_row_f64_u8)((const double *)acc, o, s, f, per_element, low, high, x, n);
            else
                HOT(float_row_i32_u8)((const int32_t *)acc, o, s, f, per_element, low, high, x, n);
        } else {
            uint16_t x = (uint16_t)job->excess;
            uint16_t *o = (uint16_t *)out;
            if (job->acc_kind == K_F32)
                HOT(float_row_f32_u16)((const float *)acc, o, s, f, per_element, low, high, x, n);
            else if (job->acc_kind == K_F64)
                HOT(float_row_f64_u16)((const double *)acc, o, s, f, per_element, low, high, x, n);
            else
                HOT(float_row_i32_u16)((const int32_t *)acc, o, s, f, per_element, low, high, x, n);
        }
        return;
    }
    HOT(float_row_strided)(job, acc, out, scale, offset, n);
}

/* One row of the int64 stage with one table entry for the row, contiguous int64 acc. */
static void HOT(int_row_i64)(const int64_t *restrict a, char *restrict out, Kind out_kind,
                             Py_ssize_t so, int64_t lower, int64_t upper, int64_t m, int64_t c,
                             int64_t shift, int64_t excess, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t x = a[k] < lower ? lower : a[k];
        x = x > upper ? upper : x;
        x = (int64_t)((uint64_t)x * (uint64_t)m + (uint64_t)c);
        int64_t code = shift >= 64 ? (x < 0 ? -1 : 0) : (shift <= 0 ? x : (x >> shift));
        store_code(out + k * so, out_kind, code ^ excess);
    }
}

/* The int64 stage of one row: codes = ((clamp(acc, lower, upper) * m + c) >> shift) ^ excess. */
static void HOT(int_row)(const StageJob *job, const char *acc, char *out,
                         const char *const *tables, Py_ssize_t n) {
    int last = job->ndim - 1;
    Py_ssize_t sa = job->acc_strides[last], so = job->out_strides[last];
    int float_acc = job->acc_kind == K_F32 || job->acc_kind == K_F64;
    int scalar = 1;
    for (int t = 0; t < 5; t++) scalar = scalar && job->table_strides[t][last] == 0;
    if (scalar && job->acc_kind == K_I64 && sa == (Py_ssize_t)sizeof(int64_t)) {
        HOT(int_row_i64)((const int64_t *)acc, out, job->out_kind, so, *(const int64_t *)tables[0],
                         *(const int64_t *)tables[1], *(const int64_t *)tables[2],
                         *(const int64_t *)tables[3], *(const int64_t *)tables[4], job->excess, n);
        return;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t lower = *(const int64_t *)(tables[0] + k * job->table_strides[0][last]);
        int64_t upper = *(const int64_t *)(tables[1] + k * job->table_strides[1][last]);
        int64_t m = *(const int64_t *)(tables[2] + k * job->table_strides[2][last]);
        int64_t c = *(const int64_t *)(tables[3] + k * job->table_strides[3][last]);
        int64_t shift = *(const int64_t *)(tables[4] + k * job->table_strides[4][last]);
        int64_t x;
        if (float_acc) {
            /* numpy compares in float64 (exact: integral values), then casts to int64 */
            double a = load_f64(acc + k * sa, job->acc_kind);
            double lo = (double)lower;
            x = (int64_t)(a < lo ? lo : a);
        } else {
            int64_t a = load_i64(acc + k * sa, job->acc_kind);
            x = a < lower ? lower : a;
        }
        x = x > upper ? upper : x;
        x = (int64_t)((uint64_t)x * (uint64_t)m); /* wraps as numpy's int64 multiply does */
        x = (int64_t)((uint64_t)x + (uint64_t)c);
        /* numpy's right_shift of an int64: arithmetic, and a shift of 64 or more gives the sign */
        int64_t code = shift >= 64 ? (x < 0 ? -1 : 0) : (shift <= 0 ? x : (x >> shift));
        char *p = out + k * so;
        store_code(p, job->out_kind, code);
        if (job->excess) store_code(p, job->out_kind, load_i64(p, job->out_kind) ^ job->excess);
    }
}

static void HOT(run_stage)(const StageJob *job) {
    int ndim = job->ndim;
    Py_ssize_t total = 1;
    for (int d = 0; d < ndim; d++) total *= job->shape[d];
    if (ndim == 0 || total == 0) return;
    Py_ssize_t index[MAX_RANK] = {0};
    Py_ssize_t n = job->shape[ndim - 1];
    Py_ssize_t rows = total / n;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const char *acc = job->acc;
        char *out = job->out;
        const char *tables[5];
        for (int t = 0; t < 5; t++) tables[t] = job->table[t];
        for (int d = 0; d < ndim - 1; d++) {
            acc += index[d] * job->acc_strides[d];
            out += index[d] * job->out_strides[d];
            for (int t = 0; t < 5; t++) tables[t] += index[d] * job->table_strides[t][d];
        }
        if (job->exact_float)
            HOT(float_row)(job, acc, out, tables[2], tables[3], n);
        else
            HOT(int_row)(job, acc, out, tables, n);
        for (int d = ndim - 2; d >= 0; d--) {
            if (++index[d] < job->shape[d]) break;
            index[d] = 0;
        }
    }
}

/* ---- depthwise --------------------------------------------------------------------------- */

/* One channel's padded plane of centred codes (padding: centred 0). */
static void HOT(centred_plane)(const DepthwiseJob *job, Py_ssize_t n, Py_ssize_t c,
                               int32_t *plane, Py_ssize_t pw, Py_ssize_t ph) {
    memset(plane, 0, (size_t)(pw * ph) * sizeof(int32_t));
    const char *base = job->codes + n * job->cs[0] + c * job->cs[1];
    int32_t zp = (int32_t)job->zero_point;
    Py_ssize_t s = job->cs[3];
    for (Py_ssize_t h = 0; h < job->height; h++) {
        const char *row = base + h * job->cs[2];
        int32_t *restrict dst = plane + (h + job->top) * pw + job->left;
        if (job->codes_kind == K_I8 && s == 1) {
            const int8_t *r = (const int8_t *)row;
            for (Py_ssize_t w = 0; w < job->width; w++) dst[w] = (int32_t)r[w] - zp;
        } else if (job->codes_kind == K_U8 && s == 1) {
            const uint8_t *r = (const uint8_t *)row;
            for (Py_ssize_t w = 0; w < job->width; w++) dst[w] = (int32_t)r[w] - zp;
        } else {
            for (Py_ssize_t w = 0; w < job->width; w++)
                dst[w] = (int32_t)(load_i64(row + w * s, job->codes_kind) - job->zero_point);
        }
    }
}

/* One output row of a KH x KW depthwise kernel of column stride SW (compile-time sizes, so the
 * taps unroll and the loop over the row's outputs vectorises):
 * row[k] = sum_ij w_ij * plane[i * dh * pw + k * SW + j * dw]. */
#define DEPTHWISE_ROW(NAME, KH, KW, SW)                                                         \
    static void HOT(NAME)(int32_t *restrict row, const int32_t *restrict plane, Py_ssize_t pw, \
                          const int32_t *restrict w, int dh, int dw, Py_ssize_t wo) {           \
        for (Py_ssize_t k = 0; k < wo; k++) {                                                   \
            int32_t a = 0;                                                                      \
            for (int i = 0; i < KH; i++)                                                        \
                for (int j = 0; j < KW; j++)                                                    \
                    a += w[i * KW + j] * plane[i * dh * pw + k * SW + j * dw];                  \
            row[k] = a;                                                                         \
        }                                                                                       \
    }

DEPTHWISE_ROW(row_3x3_s1, 3, 3, 1)
DEPTHWISE_ROW(row_3x3_s2, 3, 3, 2)
DEPTHWISE_ROW(row_5x5_s1, 5, 5, 1)
DEPTHWISE_ROW(row_5x5_s2, 5, 5, 2)

/* One output row of any kernel: a pass over the row per tap. */
static void HOT(row_any)(int32_t *restrict row, const int32_t *restrict plane, Py_ssize_t pw,
                         const int32_t *restrict w, const DepthwiseJob *job, Py_ssize_t wo) {
    memset(row, 0, (size_t)wo * sizeof(int32_t));
    for (int i = 0; i < job->kh; i++) {
        const int32_t *src = plane + (Py_ssize_t)i * job->dh * pw;
        for (int j = 0; j < job->kw; j++) {
            const int32_t wt = w[i * job->kw + j];
            const int32_t *restrict s = src + j * job->dw;
            int sw = job->sw;
            if (sw == 1)
                for (Py_ssize_t k = 0; k < wo; k++) row[k] += wt * s[k];
            else
                for (Py_ssize_t k = 0; k < wo; k++) row[k] += wt * s[k * sw];
        }
    }
}

static int HOT(run_depthwise)(const DepthwiseJob *job) {
    Py_ssize_t pw = job->width + job->left + job->right;
    Py_ssize_t ph = job->height + job->top + job->bottom;
    int32_t *plane = malloc((size_t)(pw * ph + 1) * sizeof(int32_t));
    if (plane == NULL) return -1;
    Py_ssize_t ho = job->ho, wo = job->wo;
    int taps = job->kh * job->kw;
    int kh = job->kh, kw = job->kw, sw = job->sw;
    for (Py_ssize_t n = 0; n < job->batch; n++) {
        for (Py_ssize_t c = 0; c < job->channels; c++) {
            HOT(centred_plane)(job, n, c, plane, pw, ph);
            const int32_t *w = job->weight + c * taps;
            int32_t *out = job->out + (n * job->channels + c) * ho * wo;
            for (Py_ssize_t oh = 0; oh < ho; oh++) {
                int32_t *row = out + oh * wo;
                const int32_t *top = plane + oh * job->sh * pw;
                if (kh == 3 && kw == 3 && sw == 1)
                    HOT(row_3x3_s1)(row, top, pw, w, job->dh, job->dw, wo);
                else if (kh == 3 && kw == 3 && sw == 2)
                    HOT(row_3x3_s2)(row, top, pw, w, job->dh, job->dw, wo);
                else if (kh == 5 && kw == 5 && sw == 1)
                    HOT(row_5x5_s1)(row, top, pw, w, job->dh, job->dw, wo);
                else if (kh == 5 && kw == 5 && sw == 2)
                    HOT(row_5x5_s2)(row, top, pw, w, job->dh, job->dw, wo);
                else
                    HOT(row_any)(row, top, pw, w, job, wo);
            }
        }
    }
    free(plane);
    return 0;
}

/* ---- im2col ------------------------------------------------------------------------------ */

/* One row of a tap's columns: dst[k] = codes[k * sw + off] - zero_point for k in [lo, hi), 0
 * outside (the padding, centred). */
#define COLUMN_ROW(NAME, CT, OT)                                                                \
    static void HOT(NAME)(OT *restrict dst, const CT *restrict src, Py_ssize_t sw,              \
                          Py_ssize_t off, OT zp, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t wo) { \
        for (Py_ssize_t k = 0; k < lo; k++) dst[k] = 0;                                         \
        if (sw == 1) {                                                                          \
            for (Py_ssize_t k = lo; k < hi; k++) dst[k] = (OT)src[k + off] - zp;                \
        } else if (sw == 2) {                                                                   \
            for (Py_ssize_t k = lo; k < hi; k++) dst[k] = (OT)src[2 * k + off] - zp;            \
        } else {                                                                                \
            for (Py_ssize_t k = lo; k < hi; k++) dst[k] = (OT)src[k * sw + off] - zp;           \
        }                                                                                       \
        for (Py_ssize_t k = hi; k < wo; k++) dst[k] = 0;                                        \
    }

COLUMN_ROW(columns_i8_f32, int8_t, float)
COLUMN_ROW(columns_u8_f32, uint8_t, float)
COLUMN_ROW(columns_i8_f64, int8_t, double)
COLUMN_ROW(columns_u8_f64, uint8_t, double)

static void HOT(run_im2col)(const ColumnsJob *job) {
    Py_ssize_t plane = job->rows * job->wo;
    size_t item = job->doubles ? sizeof(double) : sizeof(float);
    Py_ssize_t s = job->cs[3];
    int fast = s == 1 && (job->codes_kind == K_I8 || job->codes_kind == K_U8);
    for (Py_ssize_t n = 0; n < job->batch; n++) {
        for (Py_ssize_t c = 0; c < job->channels; c++) {
            const char *base = job->codes + n * job->cs[0] + c * job->cs[1];
            for (int i = 0; i < job->kh; i++) {
                for (int j = 0; j < job->kw; j++) {
                    Py_ssize_t tap = ((n * job->channels + c) * job->kh + i) * job->kw + j;
                    char *dst_plane = job->out + (size_t)(tap * plane) * item;
                    /* the output columns whose input column is inside the map: [lo, hi) */
                    Py_ssize_t off = (Py_ssize_t)j * job->dw - job->left;
                    Py_ssize_t lo = off >= 0 ? 0 : (-off + job->sw - 1) / job->sw;
                    Py_ssize_t hi = job->width - off > 0 ? (job->width - off - 1) / job->sw + 1 : 0;
                    if (hi > job->wo) hi = job->wo;
                    if (lo > hi) lo = hi;
                    for (Py_ssize_t r = 0; r < job->rows; r++) {
                        Py_ssize_t ih =
                            (job->row0 + r) * job->sh + (Py_ssize_t)i * job->dh - job->top;
                        char *dst = dst_plane + (size_t)(r * job->wo) * item;
                        if (ih < 0 || ih >= job->height) {
                            memset(dst, 0, (size_t)job->wo * item);
                            continue;
                        }
                        const char *row = base + ih * job->cs[2];
                        if (fast && !job->doubles) {
                            float zp = (float)job->zero_point;
                            if (job->codes_kind == K_I8)
                                HOT(columns_i8_f32)((float *)dst, (const int8_t *)row, job->sw,
                                                    off, zp, lo, hi, job->wo);
                            else
                                HOT(columns_u8_f32)((float *)dst, (const uint8_t *)row, job->sw,
                                                    off, zp, lo, hi, job->wo);
                        } else if (fast) {
                            double zp = (double)job->zero_point;
                            if (job->codes_kind == K_I8)
                                HOT(columns_i8_f64)((double *)dst, (const int8_t *)row, job->sw,
                                                    off, zp, lo, hi, job->wo);
                            else
                                HOT(columns_u8_f64)((double *)dst, (const uint8_t *)row, job->sw,
                                                    off, zp, lo, hi, job->wo);
                        } else {
                            for (Py_ssize_t k = 0; k < job->wo; k++) {
                                double v = 0.0;
                                if (k >= lo && k < hi)
                                    v = (double)(load_i64(row + (k * job->sw + off) * s,
                                                          job->codes_kind) -
                                                 job->zero_point);
                                if (job->doubles)
                                    ((double *)dst)[k] = v;
                                else
                                    ((float *)dst)[k] = (float)v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/* ---- phase planes ------------------------------------------------------------------------ */

/* One map row into its two column phases (sw = 2): padded column i + left of map column i
 * goes to phase (i + left) % 2, column (i + left) / 2, so pairs of map columns split between
 * the two phase rows. */
static void HOT(deal_pairs)(const PhaseJob *job, const uint8_t *restrict src,
                            uint8_t *restrict even, uint8_t *restrict odd) {
    Py_ssize_t width = job->width, left = job->left, pitch = job->pitch, pairs;
    const uint8_t flip = job->flip;
    uint8_t *first = (left & 1) ? odd : even, *second = (left & 1) ? even : odd;
    Py_ssize_t at_first = left / 2, at_second = (left + 1) / 2;
    pairs = width / 2;
    if (at_first + pairs > pitch) pairs = pitch - at_first;
    if (at_second + pairs > pitch) pairs = pitch - at_second;
    if (pairs < 0) pairs = 0;
    for (Py_ssize_t k = 0; k < pairs; k++) {
        first[at_first + k] = src[2 * k] ^ flip;
        second[at_second + k] = src[2 * k + 1] ^ flip;
    }
    for (Py_ssize_t i = 2 * pairs; i < width; i++) { /* an odd width's last column */
        Py_ssize_t column = (i + left) / 2;
        if (column < pitch) (((i + left) & 1) ? odd : even)[column] = src[i] ^ flip;
    }
}

/* The planes the int8 CONV kernels read (compiler/runtime/emulator_ops.py `_PhasePlanes`):
 * bytes code ^ flip, zero-padded with `pad`, each channel split into its sh x sw stride phases
 * of (rows, pitch) elements. Each phase plane is filled with the padding at once, then its
 * rows inside the map are copied: phase column x of phase (a, b) is padded column b + sw x,
 * i.e. map column b + sw x - left. */
static int HOT(run_phase_planes)(const PhaseJob *job) {
    Py_ssize_t sh = job->sh, sw = job->sw, rows = job->rows, pitch = job->pitch;
    Py_ssize_t step = sw * job->cs[3];
    const uint8_t flip = job->flip;
    for (Py_ssize_t n = 0; n < job->batch; n++)
        for (Py_ssize_t c = 0; c < job->channels; c++) {
            const char *plane = job->codes + n * job->cs[0] + c * job->cs[1];
            if (sw == 2 && job->cs[3] == 1) { /* both column phases of a row in one pass */
                uint8_t *dst = job->out + (n * job->channels + c) * sh * 2 * rows * pitch;
                memset(dst, job->pad, (size_t)(sh * 2 * rows * pitch));
                for (Py_ssize_t a = 0; a < sh; a++)
                    for (Py_ssize_t y = 0; y < rows; y++) {
                        Py_ssize_t r = a + sh * y - job->top;
                        if (r < 0 || r >= job->height) continue;
                        HOT(deal_pairs)(job, (const uint8_t *)(plane + r * job->cs[2]),
                                        dst + ((a * 2) * rows + y) * pitch,
                                        dst + ((a * 2 + 1) * rows + y) * pitch);
                    }
                continue;
            }
            for (Py_ssize_t a = 0; a < sh; a++)
                for (Py_ssize_t b = 0; b < sw; b++) {
                    uint8_t *dst =
                        job->out + (((n * job->channels + c) * sh + a) * sw + b) * rows * pitch;
                    memset(dst, job->pad, (size_t)(rows * pitch));
                    Py_ssize_t x0 = job->left > b ? (job->left - b + sw - 1) / sw : 0;
                    Py_ssize_t x1 = (job->left + job->width - b + sw - 1) / sw;
                    if (x1 > pitch) x1 = pitch;
                    if (x1 <= x0) continue;
                    Py_ssize_t count = x1 - x0, first = b + sw * x0 - job->left;
                    for (Py_ssize_t y = 0; y < rows; y++) {
                        Py_ssize_t r = a + sh * y - job->top;
                        if (r < 0 || r >= job->height) continue;
                        const uint8_t *restrict src =
                            (const uint8_t *)(plane + r * job->cs[2] + first * job->cs[3]);
                        uint8_t *restrict d = dst + y * pitch + x0;
                        if (step == 1)
                            for (Py_ssize_t x = 0; x < count; x++) d[x] = src[x] ^ flip;
                        else if (step == 2)
                            for (Py_ssize_t x = 0; x < count; x++) d[x] = src[2 * x] ^ flip;
                        else
                            for (Py_ssize_t x = 0; x < count; x++) d[x] = src[x * step] ^ flip;
                    }
                }
        }
    return 0;
}
