/* AVX2 + FMA + F16C kernels for x86-64, chosen at run time.
 *
 * The file is compiled for baseline x86-64; every function here carries
 * target("avx2,fma,f16c") and is only called after qk_cpu_has_avx2() said
 * yes, so the wheel runs on any x86-64.  The integer products follow the
 * technique of llama.cpp's ggml-cpu x86 quants: unsigned x signed byte
 * products with maddubs, widened by madd, then one float scale per block
 * applied with an FMA into an 8-lane accumulator.
 */
#include "qk.h"

#if defined(QK_HAVE_X86)
#include <cpuid.h>
#include <immintrin.h>

#include "qk_dequant.h"
#include "qk_quant.h"

#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))

/* __builtin_cpu_supports checks the CPU and that the OS saves the YMM
 * registers; clang's builtin does not know "f16c", so that bit comes from
 * CPUID leaf 1 (ECX bit 29) directly. */
int qk_cpu_has_avx2(void) {
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    return (ecx >> 29) & 1;
}

static inline QK_AVX2 float fp16(const uint8_t *p) { return _cvtsh_ss(qk_u16(p)); }

static inline QK_AVX2 float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* 16 bytes of packed nibbles -> 32 bytes: the low nibbles, then the high. */
static inline QK_AVX2 __m256i nibbles(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}

/* The 32 bits of a Q5 block's qh as 32 bytes, 0xff where bit j is set
 * (llama.cpp's bytes_from_bits_32): byte j of the result is bit j. */
static inline QK_AVX2 __m256i bits32(const uint8_t *p) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qk_u32(p)), shuf);
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);   /* every bit but bit j % 8 */
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
}

/* Sum of products of unsigned bytes u with signed bytes s, as 8 int32 lanes. */
static inline QK_AVX2 __m256i dot_us(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Each quantized kernel is written once for NR = 1..4 x rows (rows_*): the
 * weight block is loaded and unpacked once, then every x row runs the very
 * operations the NR = 1 kernel runs, in the same order, so a row's result
 * has the same bits whichever NR computed it. */
#define QK_ROWS static inline __attribute__((always_inline)) QK_AVX2 void
#define QK_MAXR 4
#define XROW(T, r, b) ((const T *)(const void *)(xb + (size_t)(r) * xs) + (b))

#define QK_ROWS_ENTRY_POINTS(NAME)                                                        \
    static QK_AVX2 float dot_##NAME(int n, const uint8_t *w, const void *x) {             \
        float y;                                                                          \
        rows_##NAME(n, w, x, 0, &y, 0, 1);                                                \
        return y;                                                                         \
    }                                                                                     \
    static QK_AVX2 void dotn_##NAME(int n, const uint8_t *w, const void *x, size_t xs,    \
                                    int nr, float *out, size_t os) {                      \
        switch (nr) {                                                                     \
        case 1: rows_##NAME(n, w, x, xs, out, os, 1); break;                              \
        case 2: rows_##NAME(n, w, x, xs, out, os, 2); break;                              \
        case 3: rows_##NAME(n, w, x, xs, out, os, 3); break;                              \
        default: rows_##NAME(n, w, x, xs, out, os, 4); break;                             \
        }                                                                                 \
    }

QK_ROWS rows_q8_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    __m256 acc[QK_MAXR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34) {
        const __m256i qw = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const float dw = fp16(w);
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            const __m256i qx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x->q), qw);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), _mm256_cvtepi32_ps(dot_us(aw, qx)), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = hsum(acc[r]);
}
QK_ROWS_ENTRY_POINTS(q8_0)

QK_ROWS rows_q4_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    __m256 acc[QK_MAXR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 18) {
        const __m256i qw = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const float dw = fp16(w);
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            const __m256i qx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x->q), qw);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), _mm256_cvtepi32_ps(dot_us(aw, qx)), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = hsum(acc[r]);
}
QK_ROWS_ENTRY_POINTS(q4_0)

QK_ROWS rows_q4_1(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    __m256 acc[QK_MAXR];
    __m128 accm[QK_MAXR];   /* lane 1: the sum of m * s */
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++, w += 20) {
        const __m256i qw = nibbles(w + 4);
        uint32_t dm_bits;
        memcpy(&dm_bits, w, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));   /* d, m */
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            const __m256i qx = _mm256_loadu_si256((const __m256i *)x->q);
            /* d * dx and m * s in one multiply: x's d and s are adjacent */
            const __m128 p = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)(const void *)&x->d)));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), _mm256_cvtepi32_ps(dot_us(qw, qx)), acc[r]);
            accm[r] = _mm_add_ps(accm[r], p);
        }
    }
    for (int r = 0; r < NR; r++)
        out[r * os] = hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(accm[r], accm[r], 1));
}
QK_ROWS_ENTRY_POINTS(q4_1)

/* Q5_0: q - 16 as a signed byte is the nibble with 0xf0 or'd in where the
 * fifth bit is clear (nibble - 16), the bare nibble where it is set; then
 * Q4_0's sign trick. */
QK_ROWS rows_q5_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    __m256 acc[QK_MAXR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 22) {
        const __m256i hi = _mm256_andnot_si256(bits32(w + 2), _mm256_set1_epi8((char)0xf0));
        const __m256i qw = _mm256_or_si256(nibbles(w + 6), hi);
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const float dw = fp16(w);
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            const __m256i qx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x->q), qw);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), _mm256_cvtepi32_ps(dot_us(aw, qx)), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = hsum(acc[r]);
}
QK_ROWS_ENTRY_POINTS(q5_0)

/* Q5_1: Q4_1 with 16 or'd into the nibbles whose fifth bit is set (maddubs
 * pair sums stay below 2 * 31 * 128 < 2^15). */
QK_ROWS rows_q5_1(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    __m256 acc[QK_MAXR];
    __m128 accm[QK_MAXR];   /* lane 1: the sum of m * s */
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++, w += 24) {
        const __m256i hi = _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10));
        const __m256i qw = _mm256_or_si256(nibbles(w + 8), hi);
        uint32_t dm_bits;
        memcpy(&dm_bits, w, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm_bits));   /* d, m */
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            const __m256i qx = _mm256_loadu_si256((const __m256i *)x->q);
            const __m128 p = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)(const void *)&x->d)));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), _mm256_cvtepi32_ps(dot_us(qw, qx)), acc[r]);
            accm[r] = _mm_add_ps(accm[r], p);
        }
    }
    for (int r = 0; r < NR; r++)
        out[r * os] = hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(accm[r], accm[r], 1));
}
QK_ROWS_ENTRY_POINTS(q5_1)

/* K-quants: per super-block, the eight (Q4_K, Q5_K) or sixteen (Q6_K)
 * sub-block scales multiply int32 lanes (madd with the scale as int16), the
 * lanes of all sub-blocks are summed as integers (each lane stays below
 * 2^24, so its conversion to float is exact), then one FMA applies d * dx.
 * The min terms of Q4_K and Q5_K use x's block sums (bsums). */
/* sum_j mn[j] * (bsums[2j] + bsums[2j+1]): pair sums fit int16 (at most
 * 32 * 127), products and sums are exact int32. */
static inline QK_AVX2 int k_mins(__m128i mn16, const int16_t *bsums) {
    const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bsums),
                                         _mm_loadu_si128((const __m128i *)(bsums + 8)));
    __m128i p = _mm_madd_epi16(mn16, pairs);
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(1, 0, 3, 2)));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(p);
}

/* The int16 scale i broadcast to every 16-bit lane of a vector holding the
 * eight scales in each 128-bit half. */
static inline QK_AVX2 __m256i k_scale(__m256i scales16, int i) {
    return _mm256_shuffle_epi8(scales16, _mm256_set1_epi16((short)(((2 * i + 1) << 8) | (2 * i))));
}

/* Q4_K and Q5_K differ only in how the 32 quants of a sub-block unpack. */
QK_ROWS rows_k45(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os,
                 const int NR, const int five) {
    const uint8_t *xb = xv;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    const int bytes = five ? 176 : 144, qs = five ? 48 : 16;
    __m256 acc[QK_MAXR];
    float accm[QK_MAXR];
    for (int r = 0; r < NR; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = 0.0f; }
    for (int b = 0; b < nb; b++, w += bytes) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        uint64_t sc64, mn64;
        memcpy(&sc64, sc, 8);
        memcpy(&mn64, mn, 8);
        const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc64)));
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn64));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        __m256i sumi[QK_MAXR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(w + qs + 32 * j));
            __m256i lo = _mm256_and_si256(q4, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
            }
            const __m256i slo = k_scale(scales16, 2 * j), shi = k_scale(scales16, 2 * j + 1);
            for (int r = 0; r < NR; r++) {
                const int8_t *y = XROW(qk_a256, r, b)->q + 64 * j;
                const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)y));
                const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 32)));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(plo, slo));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(phi, shi));
            }
        }
        const float dw = fp16(w), dminw = fp16(w + 2);
        for (int r = 0; r < NR; r++) {
            const qk_a256 *x = XROW(qk_a256, r, b);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            accm[r] += (dminw * x->d) * (float)k_mins(mn16, x->bsums);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = hsum(acc[r]) - accm[r];
}

QK_ROWS rows_q4_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    rows_k45(nb, w, xv, xs, out, os, NR, 0);
}
QK_ROWS_ENTRY_POINTS(q4_k)

QK_ROWS rows_q5_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    rows_k45(nb, w, xv, xs, out, os, NR, 1);
}
QK_ROWS_ENTRY_POINTS(q5_k)

/* Q6_K: 6-bit q = low nibble (ql) | 2 high bits (qh) << 4, stored biased by
 * 32: sum (q - 32) y = maddubs(q, y) - maddubs(32, y). */
QK_ROWS rows_q6_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
    __m256 acc[QK_MAXR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i sumi[QK_MAXR];
        for (int r = 0; r < NR; r++) sumi[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            uint64_t sc64;
            memcpy(&sc64, sc + 8 * h, 8);
            /* this half's eight scales as int16, in both 128-bit halves */
            const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_cvtsi64_si128((long long)sc64)));
            const uint8_t *ql = w + 64 * h;
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            for (int k = 0; k < 4; k++) {
                /* scale 2k for the first 16 values, 2k + 1 for the next 16 */
                const __m256i s16 = _mm256_shuffle_epi8(scales16, _mm256_set_m128i(
                    _mm_set1_epi16((short)(((4 * k + 3) << 8) | (4 * k + 2))),
                    _mm_set1_epi16((short)(((4 * k + 1) << 8) | (4 * k)))));
                for (int r = 0; r < NR; r++) {
                    const int8_t *y = XROW(qk_a256, r, b)->q + 128 * h + 32 * k;
                    const __m256i yk = _mm256_loadu_si256((const __m256i *)y);
                    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], yk), _mm256_maddubs_epi16(m32, yk));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, s16));
                }
            }
        }
        const float dw = fp16(w + 208);
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * XROW(qk_a256, r, b)->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < NR; r++) out[r * os] = hsum(acc[r]);
}
QK_ROWS_ENTRY_POINTS(q6_k)

/* Float weights: four 8-lane accumulators, then eight lanes, then the tail. */
#define QK_AVX2_FLOAT_DOT(NAME, LOAD8, LOAD1)                                       \
    static QK_AVX2 float NAME(int n, const uint8_t *w, const void *xv) {            \
        const float *x = xv;                                                        \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
        int i = 0;                                                                  \
        for (; i + 32 <= n; i += 32) {                                              \
            a0 = _mm256_fmadd_ps(LOAD8(i), _mm256_loadu_ps(x + i), a0);             \
            a1 = _mm256_fmadd_ps(LOAD8(i + 8), _mm256_loadu_ps(x + i + 8), a1);     \
            a2 = _mm256_fmadd_ps(LOAD8(i + 16), _mm256_loadu_ps(x + i + 16), a2);   \
            a3 = _mm256_fmadd_ps(LOAD8(i + 24), _mm256_loadu_ps(x + i + 24), a3);   \
        }                                                                           \
        for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(LOAD8(i), _mm256_loadu_ps(x + i), a0); \
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))); \
        for (; i < n; i++) s += LOAD1(i) * x[i];                                    \
        return s;                                                                   \
    }

#define F32_8(i) _mm256_loadu_ps((const float *)(const void *)(w + 4 * (i)))
#define F32_1(i) ((const float *)(const void *)w)[i]
#define F16_8(i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * (i))))
#define F16_1(i) fp16(w + 2 * (i))
#define BF16_8(i) _mm256_castsi256_ps(_mm256_slli_epi32(                              \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * (i)))), 16))
#define BF16_1(i) qk_bf16_to_fp32(qk_u16(w + 2 * (i)))
QK_AVX2_FLOAT_DOT(dot_f32, F32_8, F32_1)
QK_AVX2_FLOAT_DOT(dot_f16, F16_8, F16_1)
QK_AVX2_FLOAT_DOT(dot_bf16, BF16_8, BF16_1)

/* Dequantization: the plain C loops of qk_dequant.h, vectorised for AVX2. */
static QK_AVX2 void dq_f16(int n, const uint8_t *w, float *y) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, F16_8(i));
    for (; i < n; i++) y[i] = F16_1(i);
}
static QK_AVX2 void dq_bf16(int n, const uint8_t *w, float *y) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, BF16_8(i));
    for (; i < n; i++) y[i] = BF16_1(i);
}
/* Dequantization writes 8 floats per store.  The products are the ones
 * gguf's float32 code computes: d * q is exact for every format but Q6_K
 * (an fp16 times at most 11 bits), so d * q + m in one FMA rounds like
 * gguf's multiply-then-add, and Q6_K's (d * scale) * q keeps two roundings. */
static inline QK_AVX2 __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* y[0..31] = a * q + b for 32 int8 q, a and b given per 16 values. */
static inline QK_AVX2 void store32(float *y, __m256i q, __m256 a0, __m256 a1, __m256 b0, __m256 b1) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(a0, i8_to_ps(lo), b0));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(a0, i8_to_ps(_mm_srli_si128(lo, 8)), b0));
    _mm256_storeu_ps(y + 16, _mm256_fmadd_ps(a1, i8_to_ps(hi), b1));
    _mm256_storeu_ps(y + 24, _mm256_fmadd_ps(a1, i8_to_ps(_mm_srli_si128(hi, 8)), b1));
}

static inline QK_AVX2 void store32_mul(float *y, __m256i q, __m256 a0, __m256 a1) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(y, _mm256_mul_ps(a0, i8_to_ps(lo)));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(a0, i8_to_ps(_mm_srli_si128(lo, 8))));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(a1, i8_to_ps(hi)));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(a1, i8_to_ps(_mm_srli_si128(hi, 8))));
}

static QK_AVX2 void dq_q8_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 34, y += 32) {
        const __m256 d = _mm256_set1_ps(fp16(w));
        store32_mul(y, _mm256_loadu_si256((const __m256i *)(w + 2)), d, d);
    }
}

static QK_AVX2 void dq_q4_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 18, y += 32) {
        const __m256 d = _mm256_set1_ps(fp16(w));
        store32_mul(y, _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8)), d, d);
    }
}

static QK_AVX2 void dq_q4_1(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 20, y += 32) {
        const __m256 d = _mm256_set1_ps(fp16(w)), m = _mm256_set1_ps(fp16(w + 2));
        store32(y, nibbles(w + 4), d, d, m, m);
    }
}

static QK_AVX2 void dq_q5_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 22, y += 32) {
        const __m256 d = _mm256_set1_ps(fp16(w));
        const __m256i hi = _mm256_andnot_si256(bits32(w + 2), _mm256_set1_epi8((char)0xf0));
        store32_mul(y, _mm256_or_si256(nibbles(w + 6), hi), d, d);
    }
}

static QK_AVX2 void dq_q5_1(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 24, y += 32) {
        const __m256 d = _mm256_set1_ps(fp16(w)), m = _mm256_set1_ps(fp16(w + 2));
        const __m256i hi = _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10));
        store32(y, _mm256_or_si256(nibbles(w + 8), hi), d, d, m, m);
    }
}

static QK_AVX2 void dq_q4_k(int nb, const uint8_t *w, float *y) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int b = 0; b < nb; b++, w += 144, y += 256) {
        const float d = fp16(w), dmin = fp16(w + 2);
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m256 d1 = _mm256_set1_ps(d * (float)sc[2 * j]), m1 = _mm256_set1_ps(-(dmin * (float)mn[2 * j]));
            const __m256 d2 = _mm256_set1_ps(d * (float)sc[2 * j + 1]);
            const __m256 m2 = _mm256_set1_ps(-(dmin * (float)mn[2 * j + 1]));
            store32(y + 64 * j, _mm256_and_si256(q, m4), d1, d1, m1, m1);
            store32(y + 64 * j + 32, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), d2, d2, m2, m2);
        }
    }
}

static QK_AVX2 void dq_q5_k(int nb, const uint8_t *w, float *y) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    for (int b = 0; b < nb; b++, w += 176, y += 256) {
        const float d = fp16(w), dmin = fp16(w + 2);
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * j));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
            const __m256 d1 = _mm256_set1_ps(d * (float)sc[2 * j]), m1 = _mm256_set1_ps(-(dmin * (float)mn[2 * j]));
            const __m256 d2 = _mm256_set1_ps(d * (float)sc[2 * j + 1]);
            const __m256 m2 = _mm256_set1_ps(-(dmin * (float)mn[2 * j + 1]));
            store32(y + 64 * j, lo, d1, d1, m1, m1);
            store32(y + 64 * j + 32, hi, d2, d2, m2, m2);
        }
    }
}

static QK_AVX2 void dq_q6_k(int nb, const uint8_t *w, float *y) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
    for (int b = 0; b < nb; b++, w += 210, y += 256) {
        const float d = fp16(w + 208);
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h;
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
            for (int k = 0; k < 4; k++) {
                const __m256 a0 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * k]);
                const __m256 a1 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * k + 1]);
                store32_mul(y + 128 * h + 32 * k, _mm256_sub_epi8(q[k], m32), a0, a1);
            }
        }
    }
}

/* The quantizers of qk_quant.h spelled in AVX2, operation for operation
 * (gcc does not vectorise the C: its NaN-exact min/max are not
 * if-convertible).  maxps/minps with the operands in the order below return
 * what the C ternaries return, NaN included; the s tree is hsum's order. */
static inline QK_AVX2 float quant_block(int n, const float *x, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f;
    const float idf = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 id = _mm256_set1_ps(idf), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256 f = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), id);
            f = _mm256_min_ps(hi, f);
            f = _mm256_max_ps(lo, f);
            f = _mm256_and_ps(f, _mm256_cmp_ps(f, f, _CMP_ORD_Q));
            f = _mm256_sub_ps(_mm256_add_ps(f, magic), magic);
            v[k] = _mm256_cvttps_epi32(f);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
    return d;
}

static QK_AVX2 void quant_a32(int n, const float *x, qk_a32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        __m256 p = _mm256_loadu_ps(x);
        for (int i = 8; i < 32; i += 8) p = _mm256_add_ps(p, _mm256_loadu_ps(x + i));
        y->s = hsum(p);
        y->d = quant_block(32, x, y->q);
    }
}

static QK_AVX2 void quant_a256(int n, const float *x, qk_a256 *y) {
    for (int b = 0; b < n / 256; b++, x += 256, y++) {
        y->d = quant_block(256, x, y->q);
        for (int j = 0; j < 16; j += 2) {   /* two groups of 16 per 32 bytes */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(y->q + 16 * j));
            const __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q),
                                                  _mm256_set1_epi16(1));   /* 8 sums of 4 */
            const __m256i s = _mm256_hadd_epi32(s16, s16);                  /* sums of 8 */
            const __m256i t = _mm256_hadd_epi32(s, s);                      /* sums of 16 */
            y->bsums[j] = (int16_t)_mm256_extract_epi32(t, 0);
            y->bsums[j + 1] = (int16_t)_mm256_extract_epi32(t, 4);
        }
    }
}

void qk_fill_avx2(qk_isa *isa) {
    qk_fill_scalar(isa);   /* anything not listed here stays scalar */
    isa->name = "avx2";
    isa->quantize_a32 = quant_a32;
    isa->quantize_a256 = quant_a256;
    isa->dot[QK_F32] = dot_f32;
    isa->dot[QK_F16] = dot_f16;   isa->dequant[QK_F16] = dq_f16;
    isa->dot[QK_BF16] = dot_bf16; isa->dequant[QK_BF16] = dq_bf16;
    isa->dot[QK_Q4_0] = dot_q4_0; isa->dotn[QK_Q4_0] = dotn_q4_0; isa->dequant[QK_Q4_0] = dq_q4_0;
    isa->dot[QK_Q4_1] = dot_q4_1; isa->dotn[QK_Q4_1] = dotn_q4_1; isa->dequant[QK_Q4_1] = dq_q4_1;
    isa->dot[QK_Q5_0] = dot_q5_0; isa->dotn[QK_Q5_0] = dotn_q5_0; isa->dequant[QK_Q5_0] = dq_q5_0;
    isa->dot[QK_Q5_1] = dot_q5_1; isa->dotn[QK_Q5_1] = dotn_q5_1; isa->dequant[QK_Q5_1] = dq_q5_1;
    isa->dot[QK_Q8_0] = dot_q8_0; isa->dotn[QK_Q8_0] = dotn_q8_0; isa->dequant[QK_Q8_0] = dq_q8_0;
    isa->dot[QK_Q4_K] = dot_q4_k; isa->dotn[QK_Q4_K] = dotn_q4_k; isa->dequant[QK_Q4_K] = dq_q4_k;
    isa->dot[QK_Q5_K] = dot_q5_k; isa->dotn[QK_Q5_K] = dotn_q5_k; isa->dequant[QK_Q5_K] = dq_q5_k;
    isa->dot[QK_Q6_K] = dot_q6_k; isa->dotn[QK_Q6_K] = dotn_q6_k; isa->dequant[QK_Q6_K] = dq_q6_k;
}

#endif
