/* Dequantization of one row of GGUF blocks, written once as plain C.
 *
 * Included by each ISA's file: the compiler vectorises these loops for the
 * instruction set of the function they are inlined into (qk_avx2.c wraps
 * them in target("avx2") functions).  The arithmetic matches the gguf
 * package's float32 dequantization operation for operation, so both give the
 * same bits.
 */
#ifndef PMETAL_QK_DEQUANT_H
#define PMETAL_QK_DEQUANT_H

#include "qk.h"

static inline void qk_dq_f32(int n, const uint8_t *w, float *y) { memcpy(y, w, (size_t)n * 4); }

static inline void qk_dq_f16(int n, const uint8_t *w, float *y) {
    for (int i = 0; i < n; i++) y[i] = qk_fp16_to_fp32(qk_u16(w + 2 * i));
}

static inline void qk_dq_bf16(int n, const uint8_t *w, float *y) {
    for (int i = 0; i < n; i++) y[i] = qk_bf16_to_fp32(qk_u16(w + 2 * i));
}

static inline void qk_dq_q8_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 34, y += 32) {
        const float d = qk_fp16_to_fp32(qk_u16(w));
        const int8_t *q = (const int8_t *)(w + 2);
        for (int i = 0; i < 32; i++) y[i] = d * (float)q[i];
    }
}

static inline void qk_dq_q4_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 18, y += 32) {
        const float d = qk_fp16_to_fp32(qk_u16(w));
        const uint8_t *q = w + 2;
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)((q[i] & 15) - 8);
            y[i + 16] = d * (float)((q[i] >> 4) - 8);
        }
    }
}

static inline void qk_dq_q4_1(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 20, y += 32) {
        const float d = qk_fp16_to_fp32(qk_u16(w)), m = qk_fp16_to_fp32(qk_u16(w + 2));
        const uint8_t *q = w + 4;
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)(q[i] & 15) + m;
            y[i + 16] = d * (float)(q[i] >> 4) + m;
        }
    }
}

/* Q5_0: value j = (low nibble of qs[j] | bit j of qh << 4) - 16, value
 * j + 16 from the high nibble and bit j + 16; times d.  Q5_1: d q + m. */
static inline void qk_dq_q5_0(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 22, y += 32) {
        const float d = qk_fp16_to_fp32(qk_u16(w));
        const uint32_t qh = qk_u32(w + 2);
        const uint8_t *q = w + 6;
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)(((q[i] & 15) | (int)(((qh >> i) & 1) << 4)) - 16);
            y[i + 16] = d * (float)(((q[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) - 16);
        }
    }
}

static inline void qk_dq_q5_1(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 24, y += 32) {
        const float d = qk_fp16_to_fp32(qk_u16(w)), m = qk_fp16_to_fp32(qk_u16(w + 2));
        const uint32_t qh = qk_u32(w + 4);
        const uint8_t *q = w + 8;
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)((q[i] & 15) | (int)(((qh >> i) & 1) << 4)) + m;
            y[i + 16] = d * (float)((q[i] >> 4) | (int)(((qh >> (i + 16)) & 1) << 4)) + m;
        }
    }
}

static inline void qk_dq_q4_k(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 144, y += 256) {
        const float d = qk_fp16_to_fp32(qk_u16(w)), dmin = qk_fp16_to_fp32(qk_u16(w + 2));
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = w + 16 + 32 * j;
            const float d1 = d * (float)sc[2 * j], m1 = dmin * (float)mn[2 * j];
            const float d2 = d * (float)sc[2 * j + 1], m2 = dmin * (float)mn[2 * j + 1];
            float *o = y + 64 * j;
            for (int l = 0; l < 32; l++) {
                o[l] = d1 * (float)(q[l] & 15) - m1;
                o[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            }
        }
    }
}

static inline void qk_dq_q5_k(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 176, y += 256) {
        const float d = qk_fp16_to_fp32(qk_u16(w)), dmin = qk_fp16_to_fp32(qk_u16(w + 2));
        uint8_t sc[8], mn[8];
        qk_k_scales(w + 4, sc, mn);
        const uint8_t *qh = w + 16;
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = w + 48 + 32 * j;
            const float d1 = d * (float)sc[2 * j], m1 = dmin * (float)mn[2 * j];
            const float d2 = d * (float)sc[2 * j + 1], m2 = dmin * (float)mn[2 * j + 1];
            float *o = y + 64 * j;
            for (int l = 0; l < 32; l++) {
                const int lo = (q[l] & 15) | (((qh[l] >> (2 * j)) & 1) << 4);
                const int hi = (q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
                o[l] = d1 * (float)lo - m1;
                o[l + 32] = d2 * (float)hi - m2;
            }
        }
    }
}

static inline void qk_dq_q6_k(int nb, const uint8_t *w, float *y) {
    for (int b = 0; b < nb; b++, w += 210, y += 256) {
        const float d = qk_fp16_to_fp32(qk_u16(w + 208));
        const int8_t *sc = (const int8_t *)(w + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            float *o = y + 128 * h;
            const int8_t *s = sc + 8 * h;
            for (int l = 0; l < 32; l++) {
                const int q0 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q1 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                const int g = l / 16;
                o[l] = (d * (float)s[g]) * (float)q0;
                o[l + 32] = (d * (float)s[g + 2]) * (float)q1;
                o[l + 64] = (d * (float)s[g + 4]) * (float)q2;
                o[l + 96] = (d * (float)s[g + 6]) * (float)q3;
            }
        }
    }
}

#endif
