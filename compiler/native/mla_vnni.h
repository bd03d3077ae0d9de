/*
 * int8 CONV on the CPU's int8 dot products (AVX-512 VNNI), included once by mla_kernels.c.
 *
 * The MLA's MAC array computes acc = sum_k (x_k - z) * w_k over int8 codes x and centred int8
 * weights w. VNNI's vpdpbusd multiplies unsigned by signed bytes, four pairs into each int32
 * lane, so the codes are read as u = x + e (e = 128 for int8 codes, 0 for uint8), and
 *
 *     acc = sum_k u_k * w_k - c * sum_k w_k,    c = z + e,
 *
 * with padding read as u = c (centred 0). The sums wrap modulo 2**32 like the int32 lanes; the
 * caller proves the exact acc fits int32, so the wrapped result is the exact one.
 *
 * The input arrives as phase planes (built by the caller, compiler/runtime/emulator_ops.py):
 * the padded u values of each channel split into its sh x sw stride phases x[a::sh, b::sw],
 * each a (PHp, PWp) plane. Tap (i, j) of output (oh, ow) reads element (oh + ri, ow + rj) of
 * one phase (ri, rj the tap's offsets in it), i.e. flat element f + offset(tap) of that plane
 * for f = oh * PWp + ow. Over flat positions f every im2col row is then a contiguous range of
 * a plane, read in place: the accumulators are computed for every column of the pitch PWp
 * from the first output row's start to the last row's last output (columns past the output
 * width read the next row: finite sums the caller drops), and nothing past that is read.
 *
 * Output positions are taken 64 at a time (a panel: four 16-lane vectors). Four im2col rows
 * interleaved give the vpdpbusd operand (for 16 positions, four k each).
 */

#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))
#define PANEL 64

typedef struct {
    const uint8_t *planes; /* (batch, channels, phases, ph, pw) bytes, u = byte ^ flip */
    uint8_t flip;
    Py_ssize_t batch, channels, phases, ph, pw;
    const int32_t *tap_phase;  /* (taps,) phase plane of each tap, i * kw + j */
    const Py_ssize_t *tap_offset; /* (taps,) flat offset of each tap in its plane */
    Py_ssize_t taps, largest_offset;
    const int32_t *weights;     /* dense: (group, mg, k4); depthwise: (channels, k4) */
    const int32_t *corrections; /* dense: (group, mg); depthwise: (channels,) */
    int group, mg, cg;
    Py_ssize_t k, k4;
    Py_ssize_t row0;            /* dense: first output row computed */
    Py_ssize_t positions;       /* flat positions computed from row0's start */
    Py_ssize_t channel0;        /* depthwise: first channel computed */
    int32_t *out;               /* (batch, out channels, positions) accumulators, */
    void *codes;                /* or, the output stage fused, the codes' destination: */
    Py_ssize_t code_strides[3]; /* (batch, channel, row) byte strides of its rows, */
    Py_ssize_t code_width;      /* of this many (the output width) elements */
    int code_bytes;             /* of 1 or 2 bytes; */
    int rows_packed;            /* whether those rows are stored back to back, */
    int codes_flat;             /* and whether position p of a channel is its element p */
    int stage_int;              /* the stage's path: float64 (scale, offset), or int64 */
    const void *tables[5];      /* (lower, upper, multiplier, offset, shift): per output
                                   channel (all of them), float64 or int64 */
    Py_ssize_t n_scale;
    double code_low, code_high;
    int32_t excess;
    Py_ssize_t out_channels;
} PlaneJob;

/* Four rows of up to 64 bytes (the `load` mask: bytes past it are not read) interleaved and
 * XORed with `flip` (u from stored codes), for 16 positions four bytes each: v[s] holds
 * positions 16 s .. 16 s + 15, lane t of it (rows[0][p], rows[1][p], rows[2][p], rows[3][p]).
 * Bytes then words are interleaved within 128-bit lanes, then the lanes put in position
 * order. */
VNNI_TARGET static inline void interleave4(const uint8_t *r0, const uint8_t *r1,
                                           const uint8_t *r2, const uint8_t *r3, __mmask64 load,
                                           __m512i flip, __m512i v[4]) {
    __m512i a = _mm512_xor_si512(_mm512_maskz_loadu_epi8(load, (const void *)r0), flip);
    __m512i b = _mm512_xor_si512(_mm512_maskz_loadu_epi8(load, (const void *)r1), flip);
    __m512i c = _mm512_xor_si512(_mm512_maskz_loadu_epi8(load, (const void *)r2), flip);
    __m512i d = _mm512_xor_si512(_mm512_maskz_loadu_epi8(load, (const void *)r3), flip);
    __m512i lo01 = _mm512_unpacklo_epi8(a, b), hi01 = _mm512_unpackhi_epi8(a, b);
    __m512i lo23 = _mm512_unpacklo_epi8(c, d), hi23 = _mm512_unpackhi_epi8(c, d);
    __m512i q0 = _mm512_unpacklo_epi16(lo01, lo23); /* lane L: positions 16 L + 0..3 */
    __m512i q1 = _mm512_unpackhi_epi16(lo01, lo23); /* 16 L + 4..7 */
    __m512i q2 = _mm512_unpacklo_epi16(hi01, hi23); /* 16 L + 8..11 */
    __m512i q3 = _mm512_unpackhi_epi16(hi01, hi23); /* 16 L + 12..15 */
    __m512i t0 = _mm512_shuffle_i32x4(q0, q1, 0x44); /* q0.0 q0.1 q1.0 q1.1 */
    __m512i t1 = _mm512_shuffle_i32x4(q2, q3, 0x44);
    __m512i t2 = _mm512_shuffle_i32x4(q0, q1, 0xEE);
    __m512i t3 = _mm512_shuffle_i32x4(q2, q3, 0xEE);
    v[0] = _mm512_shuffle_i32x4(t0, t1, 0x88);
    v[1] = _mm512_shuffle_i32x4(t0, t1, 0xDD);
    v[2] = _mm512_shuffle_i32x4(t2, t3, 0x88);
    v[3] = _mm512_shuffle_i32x4(t2, t3, 0xDD);
}

/* acc - correction of up to 64 positions into out (masked past `count`). */
VNNI_TARGET static inline void store_panel(const __m512i acc[4], int32_t correction, int32_t *out,
                                           Py_ssize_t count) {
    __m512i c = _mm512_set1_epi32(correction);
    for (int s = 0; s < 4; s++) {
        Py_ssize_t left = count - 16 * s;
        if (left <= 0) break;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        _mm512_mask_storeu_epi32(out + 16 * s, mask, _mm512_sub_epi32(acc[s], c));
    }
}

/* The float64 output stage of 16 lanes, as compiler.intmath.FusedOutputStage runs it (its
 * exact float path): codes = (code type) clip((acc - correction) * scale + offset, low, high)
 * ^ excess, 8 lanes of doubles at a time, truncated to int32 (the code's bits in the low
 * ones). */
VNNI_TARGET static inline __m512i stage_codes(__m512i acc, __m512i correction, __m512d scale,
                                              __m512d offset, __m512d low, __m512d high,
                                              __m512i excess) {
    __m512i v = _mm512_sub_epi32(acc, correction);
    __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v));
    __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1));
    lo = _mm512_add_pd(_mm512_mul_pd(lo, scale), offset);
    hi = _mm512_add_pd(_mm512_mul_pd(hi, scale), offset);
    lo = _mm512_min_pd(_mm512_max_pd(lo, low), high);
    hi = _mm512_min_pd(_mm512_max_pd(hi, low), high);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epi32(lo)),
                                   _mm512_cvttpd_epi32(hi), 1);
    return _mm512_xor_si512(q, excess);
}

/* The int64 output stage of 16 lanes, as compiler.intmath.FusedOutputStage runs it where its
 * float path is not exact: codes = ((clamp(acc - correction, lower, upper) * m + offset) >>
 * shift) ^ excess in int64 (wrapping as numpy's does; a shift of 64 or more gives the sign),
 * the low 32 bits kept. */
VNNI_TARGET static inline __m512i stage_codes_int(__m512i acc, __m512i correction, __m512i lower,
                                                  __m512i upper, __m512i m, __m512i offset,
                                                  __m128i shift, __m512i excess) {
    __m512i v = _mm512_sub_epi32(acc, correction);
    __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
    __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1));
    lo = _mm512_min_epi64(_mm512_max_epi64(lo, lower), upper);
    hi = _mm512_min_epi64(_mm512_max_epi64(hi, lower), upper);
    lo = _mm512_sra_epi64(_mm512_add_epi64(_mm512_mullo_epi64(lo, m), offset), shift);
    hi = _mm512_sra_epi64(_mm512_add_epi64(_mm512_mullo_epi64(hi, m), offset), shift);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)),
                                   _mm512_cvtepi64_epi32(hi), 1);
    return _mm512_xor_si512(q, excess);
}

/* A panel's 16-lane vectors of codes from its accumulators, by the stage's path. */
VNNI_TARGET static inline void panel_codes(const PlaneJob *job, const __m512i acc[4],
                                           int32_t correction, Py_ssize_t channel,
                                           Py_ssize_t count, __m512i codes[4]) {
    __m512i c = _mm512_set1_epi32(correction);
    __m512i excess = _mm512_set1_epi32(job->excess);
    if (job->stage_int) {
        const int64_t *const *t = (const int64_t *const *)job->tables;
        __m512i lower = _mm512_set1_epi64(t[0][channel]), upper = _mm512_set1_epi64(t[1][channel]);
        __m512i m = _mm512_set1_epi64(t[2][channel]), offset = _mm512_set1_epi64(t[3][channel]);
        int64_t bits = t[4][channel];
        /* vpsraq takes the count as unsigned: a negative one would fill with the sign; numpy
         * leaves x as it is for a shift of 0 or less (the tables never hold one) */
        __m128i shift = _mm_cvtsi64_si128(bits > 0 ? bits : 0);
        for (int s = 0; s < 4; s++)
            codes[s] = 16 * s < count ? stage_codes_int(acc[s], c, lower, upper, m, offset,
                                                        shift, excess)
                                      : _mm512_setzero_si512();
        return;
    }
    const double *const *t = (const double *const *)job->tables;
    __m512d scale = _mm512_set1_pd(t[0][channel]), offset = _mm512_set1_pd(t[1][channel]);
    __m512d low = _mm512_set1_pd(job->code_low), high = _mm512_set1_pd(job->code_high);
    for (int s = 0; s < 4; s++)
        codes[s] = 16 * s < count ? stage_codes(acc[s], c, scale, offset, low, high, excess)
                                  : _mm512_setzero_si512();
}

/* Lanes [0, lanes) of `codes`, the results of the flat positions from (row, column) on of
 * output channel `out_channel` of image n, into the codes' destination (rows of job->code_width elements,
 * job->code_strides apart): each run of lanes inside one output row is one masked store
 * (a lane past the row's last column holds a position of no output and is not stored). */
VNNI_TARGET static inline void scatter_codes(const PlaneJob *job, __m512i codes, Py_ssize_t n,
                                             Py_ssize_t out_channel, Py_ssize_t row,
                                             Py_ssize_t column, int lanes) {
    Py_ssize_t pw = job->pw, wo = job->code_width;
    char *base = (char *)job->codes + n * job->code_strides[0] + out_channel * job->code_strides[1];
    int lane = 0;
    while (lane < lanes) {
        int run = (int)(pw - column < lanes - lane ? pw - column : lanes - lane);
        int valid = column < wo ? (int)(wo - column < run ? wo - column : run) : 0;
        if (valid > 0) {
            __mmask16 mask = (__mmask16)((((1u << valid) - 1)) << lane);
            /* lane l goes to column (column + l - lane) of this row */
            char *at = base + row * job->code_strides[2] + (column - lane) * job->code_bytes;
            if (job->code_bytes == 1)
                _mm512_mask_cvtepi32_storeu_epi8(at, mask, codes);
            else
                _mm512_mask_cvtepi32_storeu_epi16(at, mask, codes);
        }
        lane += run;
        row += 1;
        column = 0;
    }
}

static int have_vbmi2 = 0; /* set when the module loads */

/* The valid lanes of a panel's 64 codes stored one after the other (AVX-512 VBMI2's
 * compressing stores): the outputs of rows stored back to back. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) static void compress_codes(
    const __m512i codes[4], uint64_t valid, int code_bytes, char *at) {
    if (code_bytes == 1) {
        __m512i bytes = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(codes[0]));
        bytes = _mm512_inserti32x4(bytes, _mm512_cvtepi32_epi8(codes[1]), 1);
        bytes = _mm512_inserti32x4(bytes, _mm512_cvtepi32_epi8(codes[2]), 2);
        bytes = _mm512_inserti32x4(bytes, _mm512_cvtepi32_epi8(codes[3]), 3);
        _mm512_mask_compressstoreu_epi8(at, (__mmask64)valid, bytes);
        return;
    }
    __m512i low = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(codes[0])),
                                     _mm512_cvtepi32_epi16(codes[1]), 1);
    __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(codes[2])),
                                      _mm512_cvtepi32_epi16(codes[3]), 1);
    __mmask32 first = (__mmask32)(valid & 0xFFFFFFFFu), second = (__mmask32)(valid >> 32);
    _mm512_mask_compressstoreu_epi16(at, first, low);
    _mm512_mask_compressstoreu_epi16(at + 2 * __builtin_popcount(first), second, high);
}

/* Where a panel is: its first flat position and that position's row and column, which of its
 * lanes hold outputs (a column inside the output width), and where the first of those goes
 * in a destination whose rows of outputs are stored back to back. */
typedef struct {
    Py_ssize_t first, row, column;
    uint64_t valid;
    Py_ssize_t packed;
} PanelStart;

static PanelStart panel_at(const PlaneJob *job, Py_ssize_t first, Py_ssize_t count) {
    Py_ssize_t pw = job->pw, wo = job->code_width > 0 ? job->code_width : pw;
    PanelStart at = {first, first / pw, first % pw, 0, 0};
    at.packed = at.row * wo + (at.column < wo ? at.column : wo);
    Py_ssize_t column = at.column;
    for (Py_ssize_t t = 0; t < count;) {
        Py_ssize_t run = pw - column < count - t ? pw - column : count - t;
        Py_ssize_t valid = column < wo ? (wo - column < run ? wo - column : run) : 0;
        if (valid > 0) at.valid |= (valid >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << valid) - 1)) << t;
        t += run;
        column = 0;
    }
    return at;
}

/* A panel's results (`count` positions from `at` of output channel `out_channel` of image n;
 * `channel` indexes the stage's tables): accumulators into job->out, or, with the stage
 * fused, codes into their destination. */
VNNI_TARGET static inline void store_result(const PlaneJob *job, const __m512i acc[4],
                                            int32_t correction, Py_ssize_t channel, Py_ssize_t n,
                                            Py_ssize_t out_channel, PanelStart at,
                                            Py_ssize_t count) {
    if (job->codes == NULL) {
        Py_ssize_t flat = (n * job->out_channels + out_channel) * job->positions + at.first;
        store_panel(acc, correction, job->out + flat, count);
        return;
    }
    __m512i codes[4];
    panel_codes(job, acc, correction, channel, count, codes);
    if (job->codes_flat) { /* rows without gaps, stored back to back: one store a vector */
        char *base = (char *)job->codes + n * job->code_strides[0] +
                     out_channel * job->code_strides[1] + at.first * job->code_bytes;
        for (int s = 0; s < 4; s++) {
            Py_ssize_t left = count - 16 * s;
            if (left <= 0) break;
            __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            if (job->code_bytes == 1)
                _mm512_mask_cvtepi32_storeu_epi8(base + 16 * s, mask, codes[s]);
            else
                _mm512_mask_cvtepi32_storeu_epi16(base + 32 * s, mask, codes[s]);
        }
        return;
    }
    if (job->rows_packed && have_vbmi2) {
        char *base = (char *)job->codes + n * job->code_strides[0] +
                     out_channel * job->code_strides[1] + at.packed * job->code_bytes;
        compress_codes(codes, at.valid, job->code_bytes, base);
        return;
    }
    Py_ssize_t row = at.row, column = at.column;
    for (int s = 0; s < 4; s++) {
        Py_ssize_t left = count - 16 * s;
        if (left <= 0) break;
        scatter_codes(job, codes[s], n, out_channel, row, column, left >= 16 ? 16 : (int)left);
        for (column += 16; column >= job->pw; column -= job->pw) row++;
    }
}

/* ROWS output channels over the first VECS vectors (16 positions each) of one packed panel:
 * acc[r][s] += x4[q][s] . w[r][q]. */
#define VNNI_TILE(NAME, ROWS, VECS)                                                             \
    VNNI_TARGET static void NAME(const PlaneJob *job, const uint8_t *x4, Py_ssize_t k4,         \
                                 const int32_t *w, Py_ssize_t wstride, const int32_t *corr,     \
                                 Py_ssize_t channel, Py_ssize_t n, PanelStart first,            \
                                 Py_ssize_t count) {                                            \
        __m512i acc[ROWS][4];                                                                   \
        for (int r = 0; r < ROWS; r++)                                                          \
            for (int s = 0; s < 4; s++) acc[r][s] = _mm512_setzero_si512();                     \
        for (Py_ssize_t q = 0; q < k4; q++) {                                                   \
            const uint8_t *x = x4 + q * 4 * PANEL;                                              \
            __m512i xs[VECS];                                                                   \
            for (int s = 0; s < VECS; s++) xs[s] = _mm512_loadu_si512((const void *)(x + 64 * s)); \
            for (int r = 0; r < ROWS; r++) {                                                    \
                __m512i b = _mm512_set1_epi32(w[r * wstride + q]);                              \
                for (int s = 0; s < VECS; s++) acc[r][s] = _mm512_dpbusd_epi32(acc[r][s], xs[s], b); \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < ROWS; r++)                                                          \
            store_result(job, acc[r], corr[r], channel + r, n, channel + r, first, count);      \
    }

VNNI_TILE(vnni_tile_4x4, 4, 4)
VNNI_TILE(vnni_tile_1x4, 1, 4)
VNNI_TILE(vnni_tile_8x1, 8, 1)
VNNI_TILE(vnni_tile_1x1, 1, 1)

/* All output channels of a group over one packed panel of `count` positions: four channels
 * at a time over four vectors, or, for a panel of at most 16 positions (a small map), eight
 * channels over one vector. */
VNNI_TARGET static void vnni_panel(const PlaneJob *job, const uint8_t *x4, const int32_t *w,
                                   const int32_t *corr, Py_ssize_t channel, Py_ssize_t n,
                                   PanelStart first, Py_ssize_t count) {
    Py_ssize_t m = 0, mg = job->mg, k4 = job->k4;
    if (count <= 16) {
        for (; m + 8 <= mg; m += 8)
            vnni_tile_8x1(job, x4, k4, w + m * k4, k4, corr + m, channel + m, n, first, count);
        for (; m < mg; m++)
            vnni_tile_1x1(job, x4, k4, w + m * k4, k4, corr + m, channel + m, n, first, count);
        return;
    }
    for (; m + 4 <= mg; m += 4)
        vnni_tile_4x4(job, x4, k4, w + m * k4, k4, corr + m, channel + m, n, first, count);
    for (; m < mg; m++)
        vnni_tile_1x4(job, x4, k4, w + m * k4, k4, corr + m, channel + m, n, first, count);
}

static const uint8_t zero_row[PANEL];

/* The bytes of a panel of `count` positions that exist (a shorter last panel reads no further
 * than its positions). */
static inline __mmask64 panel_mask(Py_ssize_t count) {
    return count >= PANEL ? ~(__mmask64)0 : (((__mmask64)1 << count) - 1);
}

/* Four im2col rows (pointers at the block's first position; NULL for the rows that pad K,
 * read as zeros) from position `first` on, interleaved (`interleave4`). */
VNNI_TARGET static inline void interleave_rows(const uint8_t *const rows[4], Py_ssize_t first,
                                               __mmask64 load, __m512i flip, __m512i v[4]) {
    const uint8_t *r[4];
    for (int e = 0; e < 4; e++) r[e] = rows[e] != NULL ? rows[e] + first : zero_row;
    interleave4(r[0], r[1], r[2], r[3], load, flip, v);
}

/* The pointer of im2col row k (channel c of the group, tap t) at flat position 0 of the
 * block's first output row; NULL for the rows that pad K to a multiple of four. */
static const uint8_t *plane_row(const PlaneJob *job, const uint8_t *group_planes, Py_ssize_t k) {
    if (k >= job->k) return NULL;
    Py_ssize_t c = k / job->taps, t = k % job->taps, plane = job->ph * job->pw;
    return group_planes + (c * job->phases + job->tap_phase[t]) * plane +
           job->row0 * job->pw + job->tap_offset[t];
}

VNNI_TARGET static int run_conv_planes(const PlaneJob *job) {
    Py_ssize_t k4 = job->k4;
    uint8_t *x4 = malloc((size_t)(k4 * 4 * PANEL));
    const uint8_t **rows = malloc((size_t)(k4 * 4) * sizeof(*rows));
    if (x4 == NULL || rows == NULL) {
        free(x4);
        free(rows);
        return -1;
    }
    Py_ssize_t positions = job->positions;
    __m512i flip = _mm512_set1_epi8((char)job->flip);
    Py_ssize_t plane = job->ph * job->pw;
    for (Py_ssize_t n = 0; n < job->batch; n++) {
        for (int g = 0; g < job->group; g++) {
            const uint8_t *planes =
                job->planes + (n * job->channels + (Py_ssize_t)g * job->cg) * job->phases * plane;
            const int32_t *w = job->weights + (Py_ssize_t)g * job->mg * k4;
            const int32_t *corr = job->corrections + (Py_ssize_t)g * job->mg;
            Py_ssize_t channel = (Py_ssize_t)g * job->mg;
            for (Py_ssize_t k = 0; k < k4 * 4; k++) rows[k] = plane_row(job, planes, k);
            for (Py_ssize_t first = 0; first < positions; first += PANEL) {
                Py_ssize_t count = positions - first < PANEL ? positions - first : PANEL;
                PanelStart at = panel_at(job, first, count);
                __mmask64 load = panel_mask(count);
                for (Py_ssize_t q = 0; q < k4; q++) {
                    __m512i v[4];
                    interleave_rows(rows + 4 * q, first, load, flip, v);
                    for (int s = 0; s < 4; s++)
                        _mm512_storeu_si512((void *)(x4 + q * 4 * PANEL + 64 * s), v[s]);
                }
                vnni_panel(job, x4, w, corr, channel, n, at, count);
            }
        }
    }
    free(x4);
    free(rows);
    return 0;
}

/* A depthwise CONV (one input channel, one output per group) over its phase planes: each
 * channel's taps in fours, interleaved in registers and multiplied by that channel's weights,
 * for every position of its output planes (all rows of the channels asked for). */
VNNI_TARGET static int run_depthwise_planes(const PlaneJob *job) {
    Py_ssize_t plane = job->ph * job->pw;
    Py_ssize_t positions = job->positions;
    Py_ssize_t k4 = job->k4;
    __m512i flip = _mm512_set1_epi8((char)job->flip);
    /* the panels are the same for every channel: placed once */
    Py_ssize_t count_panels = (positions + PANEL - 1) / PANEL;
    PanelStart *panels = malloc((size_t)count_panels * sizeof(*panels));
    if (panels == NULL) return -1;
    for (Py_ssize_t p = 0; p < count_panels; p++) {
        Py_ssize_t first = p * PANEL;
        panels[p] = panel_at(job, first, positions - first < PANEL ? positions - first : PANEL);
    }
    for (Py_ssize_t n = 0; n < job->batch; n++) {
        for (Py_ssize_t o = 0; o < job->out_channels; o++) {
            Py_ssize_t c = job->channel0 + o;
            const uint8_t *planes = job->planes + (n * job->channels + c) * job->phases * plane;
            const int32_t *w = job->weights + c * k4;
            const uint8_t *rows[64];
            for (Py_ssize_t t = 0; t < k4 * 4; t++)
                rows[t] = t < job->taps ? planes + job->tap_phase[t] * plane + job->tap_offset[t]
                                        : NULL;
            for (Py_ssize_t first = 0, panel = 0; first < positions; first += PANEL, panel++) {
                Py_ssize_t count = positions - first < PANEL ? positions - first : PANEL;
                PanelStart at = panels[panel];
                __mmask64 load = panel_mask(count);
                __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                                  _mm512_setzero_si512(), _mm512_setzero_si512()};
                for (Py_ssize_t q = 0; q < k4; q++) {
                    __m512i v[4];
                    interleave_rows(rows + 4 * q, first, load, flip, v);
                    __m512i b = _mm512_set1_epi32(w[q]);
                    for (int s = 0; s < 4; s++) acc[s] = _mm512_dpbusd_epi32(acc[s], v[s], b);
                }
                store_result(job, acc, job->corrections[c], c, n, o, at, count);
            }
        }
    }
    free(panels);
    return 0;
}
