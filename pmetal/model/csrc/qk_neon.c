/* NEON kernels for arm64 (NEON is always there on AArch64).
 *
 * Integer products use vdotq_s32 when the compiler targets the dot-product
 * extension (__ARM_FEATURE_DOTPROD, e.g. Apple M1 and later with
 * -mcpu=apple-m1), else widening multiplies (vmull_s8) with pairwise
 * accumulation; both give the same exact int32 block sums.  Each block's
 * float step is the scalar kernel's expression, so on the quantized formats
 * these kernels return the scalar kernels' bits exactly (tests/model/
 * neon_check.c checks that under qemu).  Float weights keep eight partial
 * sums in two float32x4 FMA accumulators.
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

static float dot_q8_0(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2);
        const int s = dot32(vld1q_s8(q), vld1q_s8(q + 16), x[b].q);
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
    }
    return acc;
}

static float dot_q4_0(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t eight = vdupq_n_s8(8);
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 18) {
        const uint8x16_t v = vld1q_u8(w + 2);
        const int s = dot32(vsubq_s8(s8(vandq_u8(v, m4)), eight), vsubq_s8(s8(vshrq_n_u8(v, 4)), eight), x[b].q);
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
    }
    return acc;
}

static float dot_q4_1(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 20) {
        const uint8x16_t v = vld1q_u8(w + 4);
        const int s = dot32(s8(vandq_u8(v, m4)), s8(vshrq_n_u8(v, 4)), x[b].q);
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
        accm += qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].s;
    }
    return acc + accm;
}

static inline int k_mins(const uint8_t mn[8], const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

static float dot_q4_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 144) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        int sumi = 0;
        for (int j = 0; j < 4; j++) {
            const uint8x16_t v0 = vld1q_u8(w + 16 + 32 * j), v1 = vld1q_u8(w + 32 + 32 * j);
            const int8_t *y = x[b].q + 64 * j;
            sumi += sc[2 * j] * dot32(s8(vandq_u8(v0, m4)), s8(vandq_u8(v1, m4)), y)
                  + sc[2 * j + 1] * dot32(s8(vshrq_n_u8(v0, 4)), s8(vshrq_n_u8(v1, 4)), y + 32);
        }
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)sumi;
        accm += (qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].d) * (float)k_mins(mn, x[b].bsums);
    }
    return acc - accm;
}

static float dot_q5_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), one = vdupq_n_u8(1);
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 176) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        uint8x16_t h0 = vld1q_u8(w + 16), h1 = vld1q_u8(w + 32);
        int sumi = 0;
        for (int j = 0; j < 4; j++) {
            const uint8x16_t v0 = vld1q_u8(w + 48 + 32 * j), v1 = vld1q_u8(w + 64 + 32 * j);
            const int8_t *y = x[b].q + 64 * j;
            const uint8x16_t l0 = vorrq_u8(vandq_u8(v0, m4), vshlq_n_u8(vandq_u8(h0, one), 4));
            const uint8x16_t l1 = vorrq_u8(vandq_u8(v1, m4), vshlq_n_u8(vandq_u8(h1, one), 4));
            const uint8x16_t u0 = vorrq_u8(vshrq_n_u8(v0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h0, 1), one), 4));
            const uint8x16_t u1 = vorrq_u8(vshrq_n_u8(v1, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h1, 1), one), 4));
            sumi += sc[2 * j] * dot32(s8(l0), s8(l1), y) + sc[2 * j + 1] * dot32(s8(u0), s8(u1), y + 32);
            h0 = vshrq_n_u8(h0, 2);
            h1 = vshrq_n_u8(h1, 2);
        }
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)sumi;
        accm += (qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].d) * (float)k_mins(mn, x[b].bsums);
    }
    return acc - accm;
}

/* Sum over 16 values of (q - 32) * y, q given as unsigned 6-bit bytes. */
static inline int dot16_q6(uint8x16_t q, const int8_t *y) {
    const int8x16_t v = vsubq_s8(s8(q), vdupq_n_s8(32));
    return vaddvq_s32(dot16(vdupq_n_s32(0), v, vld1q_s8(y)));
}

static float dot_q6_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m3 = vdupq_n_u8(3);
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int sumi = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *y = x[b].q + 128 * h;
            for (int g = 0; g < 2; g++) {   /* the 16-value groups of each 32 */
                const uint8x16_t a = vld1q_u8(ql + 16 * g), c = vld1q_u8(ql + 32 + 16 * g);
                const uint8x16_t hb = vld1q_u8(qh + 16 * g);
                const uint8x16_t q0 = vorrq_u8(vandq_u8(a, m4), vshlq_n_u8(vandq_u8(hb, m3), 4));
                const uint8x16_t q1 = vorrq_u8(vandq_u8(c, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4));
                const uint8x16_t q2 = vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4));
                const uint8x16_t q3 = vorrq_u8(vshrq_n_u8(c, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4));
                sumi += sc[8 * h + g] * dot16_q6(q0, y + 16 * g)
                      + sc[8 * h + g + 2] * dot16_q6(q1, y + 32 + 16 * g)
                      + sc[8 * h + g + 4] * dot16_q6(q2, y + 64 + 16 * g)
                      + sc[8 * h + g + 6] * dot16_q6(q3, y + 96 + 16 * g);
            }
        }
        acc += (qk_fp16_to_fp32(qk_u16(w + 208)) * x[b].d) * (float)sumi;
    }
    return acc;
}

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

void qk_fill_neon(qk_isa *isa) {
    qk_fill_scalar(isa);   /* dequantize: the scalar loops, auto-vectorised for NEON */
#if defined(__ARM_FEATURE_DOTPROD)
    isa->name = "neon+dotprod";
#else
    isa->name = "neon";
#endif
    isa->dot[QK_F32] = dot_f32;
    isa->dot[QK_F16] = dot_f16;
    isa->dot[QK_BF16] = dot_bf16;
    isa->dot[QK_Q4_0] = dot_q4_0;
    isa->dot[QK_Q4_1] = dot_q4_1;
    isa->dot[QK_Q8_0] = dot_q8_0;
    isa->dot[QK_Q4_K] = dot_q4_k;
    isa->dot[QK_Q5_K] = dot_q5_k;
    isa->dot[QK_Q6_K] = dot_q6_k;
}

#endif
