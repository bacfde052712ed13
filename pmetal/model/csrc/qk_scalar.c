/* The portable kernels: plain C for any CPU, and the reference the SIMD
 * kernels are tested against.
 *
 * Integer sums are exact (int32 cannot overflow for these block sizes); each
 * block adds one float term (scale * integer sum) to one accumulator, so a
 * product passes through at most (blocks + 4) float roundings.  The float
 * types keep eight partial sums, like an 8-lane vector.
 */
#include "qk.h"
#include "qk_dequant.h"

static float dot_q8_0(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2);
        int s = 0;
        for (int i = 0; i < 32; i++) s += q[i] * x[b].q[i];
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
    }
    return acc;
}

static float dot_q4_0(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 18) {
        const uint8_t *q = w + 2;
        int s = 0;
        for (int i = 0; i < 16; i++)
            s += ((q[i] & 15) - 8) * x[b].q[i] + ((q[i] >> 4) - 8) * x[b].q[i + 16];
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
    }
    return acc;
}

static float dot_q4_1(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 20) {
        const uint8_t *q = w + 4;
        int s = 0;
        for (int i = 0; i < 16; i++) s += (q[i] & 15) * x[b].q[i] + (q[i] >> 4) * x[b].q[i + 16];
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
        accm += qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].s;
    }
    return acc + accm;
}

static float dot_q5_0(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 22) {
        const uint32_t qh = qk_u32(w + 2);
        const uint8_t *q = w + 6;
        int s = 0;
        for (int i = 0; i < 16; i++)
            s += (((q[i] & 15) | (int)(((qh >> i) & 1) << 4)) - 16) * x[b].q[i]
               + (((q[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) - 16) * x[b].q[i + 16];
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
    }
    return acc;
}

static float dot_q5_1(int nb, const uint8_t *w, const void *xv) {
    const qk_a32 *x = xv;
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 24) {
        const uint32_t qh = qk_u32(w + 4);
        const uint8_t *q = w + 8;
        int s = 0;
        for (int i = 0; i < 16; i++)
            s += ((q[i] & 15) | (int)(((qh >> i) & 1) << 4)) * x[b].q[i]
               + ((q[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) * x[b].q[i + 16];
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)s;
        accm += qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].s;
    }
    return acc + accm;
}

static float dot_q4_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 144) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = w + 16 + 32 * j;
            const int8_t *y = x[b].q + 64 * j;
            int s1 = 0, s2 = 0;
            for (int l = 0; l < 32; l++) { s1 += (q[l] & 15) * y[l]; s2 += (q[l] >> 4) * y[l + 32]; }
            sumi += sc[2 * j] * s1 + sc[2 * j + 1] * s2;
            summ += mn[2 * j] * (x[b].bsums[4 * j] + x[b].bsums[4 * j + 1])
                  + mn[2 * j + 1] * (x[b].bsums[4 * j + 2] + x[b].bsums[4 * j + 3]);
        }
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)sumi;
        accm += (qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].d) * (float)summ;
    }
    return acc - accm;
}

static float dot_q5_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++, w += 176) {
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        const uint8_t *qh = w + 16;
        int sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = w + 48 + 32 * j;
            const int8_t *y = x[b].q + 64 * j;
            int s1 = 0, s2 = 0;
            for (int l = 0; l < 32; l++) {
                s1 += ((q[l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4)) * y[l];
                s2 += ((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) * y[l + 32];
            }
            sumi += sc[2 * j] * s1 + sc[2 * j + 1] * s2;
            summ += mn[2 * j] * (x[b].bsums[4 * j] + x[b].bsums[4 * j + 1])
                  + mn[2 * j + 1] * (x[b].bsums[4 * j + 2] + x[b].bsums[4 * j + 3]);
        }
        acc += (qk_fp16_to_fp32(qk_u16(w)) * x[b].d) * (float)sumi;
        accm += (qk_fp16_to_fp32(qk_u16(w + 2)) * x[b].d) * (float)summ;
    }
    return acc - accm;
}

static float dot_q6_k(int nb, const uint8_t *w, const void *xv) {
    const qk_a256 *x = xv;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        int sumi = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *y = x[b].q + 128 * h;
            int s[8] = {0};
            for (int l = 0; l < 32; l++) {
                const int g = l / 16;
                s[g] += (((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32) * y[l];
                s[g + 2] += (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32) * y[l + 32];
                s[g + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * y[l + 64];
                s[g + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * y[l + 96];
            }
            for (int g = 0; g < 8; g++) sumi += sc[8 * h + g] * s[g];
        }
        acc += (qk_fp16_to_fp32(qk_u16(w + 208)) * x[b].d) * (float)sumi;
    }
    return acc;
}

/* Eight partial sums combined pairwise, then the tail of fewer than eight. */
#define QK_FLOAT_DOT(NAME, LOAD)                                              \
    static float NAME(int n, const uint8_t *w, const void *xv) {              \
        const float *x = xv;                                                  \
        float a[8] = {0};                                                     \
        int i = 0;                                                            \
        for (; i + 8 <= n; i += 8)                                            \
            for (int k = 0; k < 8; k++) a[k] += LOAD(i + k) * x[i + k];       \
        float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); \
        for (; i < n; i++) s += LOAD(i) * x[i];                               \
        return s;                                                             \
    }

static inline float load_f32(const uint8_t *w, int i) { float v; memcpy(&v, w + 4 * i, 4); return v; }
#define LOAD_F32(i) load_f32(w, (i))
#define LOAD_F16(i) qk_fp16_to_fp32(qk_u16(w + 2 * (i)))
#define LOAD_BF16(i) qk_bf16_to_fp32(qk_u16(w + 2 * (i)))
QK_FLOAT_DOT(dot_f32, LOAD_F32)
QK_FLOAT_DOT(dot_f16, LOAD_F16)
QK_FLOAT_DOT(dot_bf16, LOAD_BF16)

static void dq_f32(int n, const uint8_t *w, float *y) { qk_dq_f32(n, w, y); }
static void dq_f16(int n, const uint8_t *w, float *y) { qk_dq_f16(n, w, y); }
static void dq_bf16(int n, const uint8_t *w, float *y) { qk_dq_bf16(n, w, y); }
static void dq_q4_0(int n, const uint8_t *w, float *y) { qk_dq_q4_0(n, w, y); }
static void dq_q4_1(int n, const uint8_t *w, float *y) { qk_dq_q4_1(n, w, y); }
static void dq_q5_0(int n, const uint8_t *w, float *y) { qk_dq_q5_0(n, w, y); }
static void dq_q5_1(int n, const uint8_t *w, float *y) { qk_dq_q5_1(n, w, y); }
static void dq_q8_0(int n, const uint8_t *w, float *y) { qk_dq_q8_0(n, w, y); }
static void dq_q4_k(int n, const uint8_t *w, float *y) { qk_dq_q4_k(n, w, y); }
static void dq_q5_k(int n, const uint8_t *w, float *y) { qk_dq_q5_k(n, w, y); }
static void dq_q6_k(int n, const uint8_t *w, float *y) { qk_dq_q6_k(n, w, y); }

void qk_fill_scalar(qk_isa *isa) {
    memset(isa, 0, sizeof *isa);
    isa->name = "scalar";
    isa->quantize_a32 = qk_quantize_a32;
    isa->quantize_a256 = qk_quantize_a256;
    isa->dot[QK_F32] = dot_f32;   isa->dequant[QK_F32] = dq_f32;
    isa->dot[QK_F16] = dot_f16;   isa->dequant[QK_F16] = dq_f16;
    isa->dot[QK_BF16] = dot_bf16; isa->dequant[QK_BF16] = dq_bf16;
    isa->dot[QK_Q4_0] = dot_q4_0; isa->dequant[QK_Q4_0] = dq_q4_0;
    isa->dot[QK_Q4_1] = dot_q4_1; isa->dequant[QK_Q4_1] = dq_q4_1;
    isa->dot[QK_Q5_0] = dot_q5_0; isa->dequant[QK_Q5_0] = dq_q5_0;
    isa->dot[QK_Q5_1] = dot_q5_1; isa->dequant[QK_Q5_1] = dq_q5_1;
    isa->dot[QK_Q8_0] = dot_q8_0; isa->dequant[QK_Q8_0] = dq_q8_0;
    isa->dot[QK_Q4_K] = dot_q4_k; isa->dequant[QK_Q4_K] = dq_q4_k;
    isa->dot[QK_Q5_K] = dot_q5_k; isa->dequant[QK_Q5_K] = dq_q5_k;
    isa->dot[QK_Q6_K] = dot_q6_k; isa->dequant[QK_Q6_K] = dq_q6_k;
}
