/* NEON kernels for arm64 (NEON is always there on AArch64).
 *
 * Integer products use vdotq_s32 when the compiler targets the dot-product
 * extension (__ARM_FEATURE_DOTPROD, e.g. Apple M1 and later with
 * -mcpu=apple-m1), else widening multiplies (vmull_s8) with pairwise
 * accumulation; both give the same exact int32 block sums.  Each block's
 * float step is the scalar kernel's expression, so on the quantized formats
 * these kernels return the scalar kernels' bits exactly (tests/model/
 * isa_check.c checks that under qemu).  Float weights keep eight partial
 * sums in two float32x4 FMA accumulators.  The quantized kernels unpack a
 * weight block once for up to 4 x rows, like the AVX2 ones.
 */
#include "qk.h"

#if defined(__aarch64__)
#include <arm_neon.h>

#include "qk_dequant.h"

static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_s8(vget_high_s8(a), vget_high_s8(b)));
#endif
}

/* Sum of a[i] * y[i] over 32 values given as two 16-byte halves. */
static inline int dot32(int8x16_t a0, int8x16_t a1, const int8_t *y) {
    int32x4_t acc = dot16(vdupq_n_s32(0), a0, vld1q_s8(y));
    return vaddvq_s32(dot16(acc, a1, vld1q_s8(y + 16)));
}

static inline int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }

/* Each quantized kernel is written once for NR = 1..4 x rows (rows_*): the
 * weight block is unpacked once, then every x row runs the operations of
 * the NR = 1 kernel in the same order. */
#define QK_ROWS static inline __attribute__((always_inline)) void
#define QK_MAXR 4
#define XROW(T, r, b) ((const T *)(const void *)(xb + (size_t)(r) * xs) + (b))

#define QK_ROWS_ENTRY_POINTS(NAME)                                                        \
    static float dot_##NAME(int n, const uint8_t *w, const void *x) {                     \
        float y;                                                                          \
        rows_##NAME(n, w, x, 0, &y, 0, 1);                                                \
        return y;                                                                         \
    }                                                                                     \
    static void dotn_##NAME(int n, const uint8_t *w, const void *x, size_t xs, int nr,    \
                            float *out, size_t os) {                                      \
        switch (nr) {                                                                     \
        case 1: rows_##NAME(n, w, x, xs, out, os, 1); break;                              \
        case 2: rows_##NAME(n, w, x, xs, out, os, 2); break;                              \
        case 3: rows_##NAME(n, w, x, xs, out, os, 3); break;                              \
        default: rows_##NAME(n, w, x, xs, out, os, 4); break;                             \
        }                                                                                 \
    }

QK_ROWS rows_q8_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    float acc[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 34) {
        const int8x16_t q0 = vld1q_s8((const int8_t *)(w + 2)), q1 = vld1q_s8((const int8_t *)(w + 18));
        const float dw = qk_fp16_to_fp32(qk_u16(w));
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            acc[r] += (dw * x->d) * (float)dot32(q0, q1, x->q);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r];
}
QK_ROWS_ENTRY_POINTS(q8_0)

QK_ROWS rows_q4_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t eight = vdupq_n_s8(8);
    float acc[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 18) {
        const uint8x16_t v = vld1q_u8(w + 2);
        const int8x16_t lo = vsubq_s8(s8(vandq_u8(v, m4)), eight), hi = vsubq_s8(s8(vshrq_n_u8(v, 4)), eight);
        const float dw = qk_fp16_to_fp32(qk_u16(w));
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            acc[r] += (dw * x->d) * (float)dot32(lo, hi, x->q);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r];
}
QK_ROWS_ENTRY_POINTS(q4_0)

QK_ROWS rows_q4_1(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float acc[QK_MAXR] = {0}, accm[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 20) {
        const uint8x16_t v = vld1q_u8(w + 4);
        const int8x16_t lo = s8(vandq_u8(v, m4)), hi = s8(vshrq_n_u8(v, 4));
        const float dw = qk_fp16_to_fp32(qk_u16(w)), mw = qk_fp16_to_fp32(qk_u16(w + 2));
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            acc[r] += (dw * x->d) * (float)dot32(lo, hi, x->q);
            accm[r] += mw * x->s;
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r] + accm[r];
}
QK_ROWS_ENTRY_POINTS(q4_1)

/* The fifth bits of values 16 h .. 16 h + 15 of a Q5 block, as 0x10 where
 * set and 0 where not: byte j of each 8-byte half tests bit j % 8 of the
 * qh byte that half repeats. */
static inline uint8x16_t bits16(uint32_t qh, int h) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)(qh >> (16 * h))), vdup_n_u8((uint8_t)(qh >> (16 * h + 8))));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

QK_ROWS rows_q5_0(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t sixteen = vdupq_n_s8(16);
    float acc[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 22) {
        const uint32_t qh = qk_u32(w + 2);
        const uint8x16_t v = vld1q_u8(w + 6);
        const int8x16_t lo = vsubq_s8(s8(vorrq_u8(vandq_u8(v, m4), bits16(qh, 0))), sixteen);
        const int8x16_t hi = vsubq_s8(s8(vorrq_u8(vshrq_n_u8(v, 4), bits16(qh, 1))), sixteen);
        const float dw = qk_fp16_to_fp32(qk_u16(w));
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            acc[r] += (dw * x->d) * (float)dot32(lo, hi, x->q);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r];
}
QK_ROWS_ENTRY_POINTS(q5_0)

QK_ROWS rows_q5_1(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float acc[QK_MAXR] = {0}, accm[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 24) {
        const uint32_t qh = qk_u32(w + 4);
        const uint8x16_t v = vld1q_u8(w + 8);
        const int8x16_t lo = s8(vorrq_u8(vandq_u8(v, m4), bits16(qh, 0)));
        const int8x16_t hi = s8(vorrq_u8(vshrq_n_u8(v, 4), bits16(qh, 1)));
        const float dw = qk_fp16_to_fp32(qk_u16(w)), mw = qk_fp16_to_fp32(qk_u16(w + 2));
        for (int r = 0; r < NR; r++) {
            const qk_a32 *x = XROW(qk_a32, r, b);
            acc[r] += (dw * x->d) * (float)dot32(lo, hi, x->q);
            accm[r] += mw * x->s;
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r] + accm[r];
}
QK_ROWS_ENTRY_POINTS(q5_1)

static inline int k_mins(const uint8_t mn[8], const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* Q4_K and Q5_K differ only in how the 32 quants of a sub-block unpack. */
QK_ROWS rows_k45(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os,
                 const int NR, const int five) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), one = vdupq_n_u8(1);
    const int bytes = five ? 176 : 144, qs = five ? 48 : 16;
    float acc[QK_MAXR] = {0}, accm[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += bytes) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        uint8x16_t h0 = five ? vld1q_u8(w + 16) : vdupq_n_u8(0), h1 = five ? vld1q_u8(w + 32) : vdupq_n_u8(0);
        int sumi[QK_MAXR] = {0};
        for (int j = 0; j < 4; j++) {
            const uint8x16_t v0 = vld1q_u8(w + qs + 32 * j), v1 = vld1q_u8(w + qs + 16 + 32 * j);
            uint8x16_t l0 = vandq_u8(v0, m4), l1 = vandq_u8(v1, m4), u0 = vshrq_n_u8(v0, 4), u1 = vshrq_n_u8(v1, 4);
            if (five) {
                l0 = vorrq_u8(l0, vshlq_n_u8(vandq_u8(h0, one), 4));
                l1 = vorrq_u8(l1, vshlq_n_u8(vandq_u8(h1, one), 4));
                u0 = vorrq_u8(u0, vshlq_n_u8(vandq_u8(vshrq_n_u8(h0, 1), one), 4));
                u1 = vorrq_u8(u1, vshlq_n_u8(vandq_u8(vshrq_n_u8(h1, 1), one), 4));
                h0 = vshrq_n_u8(h0, 2);
                h1 = vshrq_n_u8(h1, 2);
            }
            for (int r = 0; r < NR; r++) {
                const int8_t *y = XROW(qk_a256, r, b)->q + 64 * j;
                sumi[r] += sc[2 * j] * dot32(s8(l0), s8(l1), y) + sc[2 * j + 1] * dot32(s8(u0), s8(u1), y + 32);
            }
        }
        const float dw = qk_fp16_to_fp32(qk_u16(w)), dminw = qk_fp16_to_fp32(qk_u16(w + 2));
        for (int r = 0; r < NR; r++) {
            const qk_a256 *x = XROW(qk_a256, r, b);
            acc[r] += (dw * x->d) * (float)sumi[r];
            accm[r] += (dminw * x->d) * (float)k_mins(mn, x->bsums);
        }
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r] - accm[r];
}

QK_ROWS rows_q4_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    rows_k45(nb, w, xv, xs, out, os, NR, 0);
}
QK_ROWS_ENTRY_POINTS(q4_k)

QK_ROWS rows_q5_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    rows_k45(nb, w, xv, xs, out, os, NR, 1);
}
QK_ROWS_ENTRY_POINTS(q5_k)

/* Sum over 16 values of (q - 32) * y, q given as unsigned 6-bit bytes. */
static inline int dot16_q6(int8x16_t q, const int8_t *y) {
    return vaddvq_s32(dot16(vdupq_n_s32(0), q, vld1q_s8(y)));
}

QK_ROWS rows_q6_k(int nb, const uint8_t *w, const void *xv, size_t xs, float *out, size_t os, const int NR) {
    const uint8_t *xb = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m3 = vdupq_n_u8(3);
    const int8x16_t m32 = vdupq_n_s8(32);
    float acc[QK_MAXR] = {0};
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int sumi[QK_MAXR] = {0};
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            for (int g = 0; g < 2; g++) {   /* the 16-value groups of each 32 */
                const uint8x16_t a = vld1q_u8(ql + 16 * g), c = vld1q_u8(ql + 32 + 16 * g);
                const uint8x16_t hb = vld1q_u8(qh + 16 * g);
                int8x16_t q[4];
                q[0] = vsubq_s8(s8(vorrq_u8(vandq_u8(a, m4), vshlq_n_u8(vandq_u8(hb, m3), 4))), m32);
                q[1] = vsubq_s8(s8(vorrq_u8(vandq_u8(c, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4))), m32);
                q[2] = vsubq_s8(s8(vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4))), m32);
                q[3] = vsubq_s8(s8(vorrq_u8(vshrq_n_u8(c, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))), m32);
                for (int r = 0; r < NR; r++) {
                    const int8_t *y = XROW(qk_a256, r, b)->q + 128 * h + 16 * g;
                    sumi[r] += sc[8 * h + g] * dot16_q6(q[0], y) + sc[8 * h + g + 2] * dot16_q6(q[1], y + 32)
                             + sc[8 * h + g + 4] * dot16_q6(q[2], y + 64) + sc[8 * h + g + 6] * dot16_q6(q[3], y + 96);
                }
            }
        }
        const float dw = qk_fp16_to_fp32(qk_u16(w + 208));
        for (int r = 0; r < NR; r++) acc[r] += (dw * XROW(qk_a256, r, b)->d) * (float)sumi[r];
    }
    for (int r = 0; r < NR; r++) out[r * os] = acc[r];
}
QK_ROWS_ENTRY_POINTS(q6_k)

/* Float weights: two float32x4 FMA accumulators (eight partial sums). */
#define QK_NEON_FLOAT_DOT(NAME, LOAD4, LOAD1)                                       \
    static float NAME(int n, const uint8_t *w, const void *xv) {                    \
        const float *x = xv;                                                        \
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;                                \
        int i = 0;                                                                  \
        for (; i + 8 <= n; i += 8) {                                                \
            a0 = vfmaq_f32(a0, LOAD4(i), vld1q_f32(x + i));                         \
            a1 = vfmaq_f32(a1, LOAD4(i + 4), vld1q_f32(x + i + 4));                 \
        }                                                                           \
        float s = vaddvq_f32(vaddq_f32(a0, a1));                                    \
        for (; i < n; i++) s += LOAD1(i) * x[i];                                    \
        return s;                                                                   \
    }

#define F32_4(i) vreinterpretq_f32_u8(vld1q_u8(w + 4 * (i)))
#define F32_1(i) qk_f32_at(w, (i))
#define F16_4(i) vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + 2 * (i))))
#define F16_1(i) qk_fp16_to_fp32(qk_u16(w + 2 * (i)))
#define BF16_4(i) vreinterpretq_f32_u32(vshll_n_u16(vreinterpret_u16_u8(vld1_u8(w + 2 * (i))), 16))
#define BF16_1(i) qk_bf16_to_fp32(qk_u16(w + 2 * (i)))
static inline float qk_f32_at(const uint8_t *w, int i) { float v; memcpy(&v, w + 4 * i, 4); return v; }
QK_NEON_FLOAT_DOT(dot_f32, F32_4, F32_1)
QK_NEON_FLOAT_DOT(dot_f16, F16_4, F16_1)
QK_NEON_FLOAT_DOT(dot_bf16, BF16_4, BF16_1)

/* The quantizers of qk_quant.h spelled in NEON, operation for operation:
 * bit-selects reproduce the C ternaries exactly (vmaxq_f32 would not: it
 * propagates NaN), and the s tree is the C expression's order. */
static inline float quant_block(int n, const float *x, int8_t *q) {
    float32x4_t m0 = vdupq_n_f32(0.0f), m1 = m0;
    for (int i = 0; i < n; i += 8) {
        const float32x4_t a0 = vabsq_f32(vld1q_f32(x + i)), a1 = vabsq_f32(vld1q_f32(x + i + 4));
        m0 = vbslq_f32(vcgtq_f32(a0, m0), a0, m0);
        m1 = vbslq_f32(vcgtq_f32(a1, m1), a1, m1);
    }
    const float amax = vmaxvq_f32(vmaxq_f32(m0, m1));   /* no NaN left, all >= +0 */
    const float d = amax / 127.0f;
    const float idf = d != 0.0f ? 1.0f / d : 0.0f;
    const float32x4_t id = vdupq_n_f32(idf), hi = vdupq_n_f32(127.0f), lo = vdupq_n_f32(-127.0f);
    const float32x4_t magic = vdupq_n_f32(12582912.0f), zero = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 8) {
        int32x4_t v[2];
        for (int k = 0; k < 2; k++) {
            float32x4_t f = vmulq_f32(vld1q_f32(x + i + 4 * k), id);
            f = vbslq_f32(vcgtq_f32(f, hi), hi, f);
            f = vbslq_f32(vcltq_f32(f, lo), lo, f);
            f = vbslq_f32(vceqq_f32(f, f), f, zero);
            f = vsubq_f32(vaddq_f32(f, magic), magic);
            v[k] = vcvtq_s32_f32(f);
        }
        vst1_s8(q + i, vmovn_s16(vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]))));
    }
    return d;
}

static void quant_a32(int n, const float *x, qk_a32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        float32x4_t p0 = vld1q_f32(x), p1 = vld1q_f32(x + 4);
        for (int i = 8; i < 32; i += 8) {
            p0 = vaddq_f32(p0, vld1q_f32(x + i));
            p1 = vaddq_f32(p1, vld1q_f32(x + i + 4));
        }
        const float32x4_t t = vaddq_f32(p0, p1);                 /* p0+p4, p1+p5, p2+p6, p3+p7 */
        const float32x4_t u = vaddq_f32(t, vextq_f32(t, t, 2));  /* (p0+p4)+(p2+p6), (p1+p5)+(p3+p7) */
        y->s = vgetq_lane_f32(u, 0) + vgetq_lane_f32(u, 1);
        y->d = quant_block(32, x, y->q);
    }
}

static void quant_a256(int n, const float *x, qk_a256 *y) {
    for (int b = 0; b < n / 256; b++, x += 256, y++) {
        y->d = quant_block(256, x, y->q);
        for (int j = 0; j < 16; j++) y->bsums[j] = (int16_t)vaddlvq_s8(vld1q_s8(y->q + 16 * j));
    }
}

void qk_fill_neon(qk_isa *isa) {
    qk_fill_scalar(isa);   /* dequantize: the scalar loops, auto-vectorised for NEON */
#if defined(__ARM_FEATURE_DOTPROD)
    isa->name = "neon+dotprod";
#else
    isa->name = "neon";
#endif
    isa->quantize_a32 = quant_a32;
    isa->quantize_a256 = quant_a256;
    isa->dot[QK_F32] = dot_f32;
    isa->dot[QK_F16] = dot_f16;
    isa->dot[QK_BF16] = dot_bf16;
    isa->dot[QK_Q4_0] = dot_q4_0; isa->dotn[QK_Q4_0] = dotn_q4_0;
    isa->dot[QK_Q4_1] = dot_q4_1; isa->dotn[QK_Q4_1] = dotn_q4_1;
    isa->dot[QK_Q5_0] = dot_q5_0; isa->dotn[QK_Q5_0] = dotn_q5_0;
    isa->dot[QK_Q5_1] = dot_q5_1; isa->dotn[QK_Q5_1] = dotn_q5_1;
    isa->dot[QK_Q8_0] = dot_q8_0; isa->dotn[QK_Q8_0] = dotn_q8_0;
    isa->dot[QK_Q4_K] = dot_q4_k; isa->dotn[QK_Q4_K] = dotn_q4_k;
    isa->dot[QK_Q5_K] = dot_q5_k; isa->dotn[QK_Q5_K] = dotn_q5_k;
    isa->dot[QK_Q6_K] = dot_q6_k; isa->dotn[QK_Q6_K] = dotn_q6_k;
}

#endif
