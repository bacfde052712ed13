/* Quantization of x rows to the activation formats, written once as plain
 * C that compilers vectorise (no libm calls, no reductions they may not
 * reorder), and compiled once per instruction set.  Every operation is an
 * IEEE float operation in a fixed order, so every ISA produces the same bits.
 */
#ifndef PMETAL_QK_QUANT_H
#define PMETAL_QK_QUANT_H

#include "qk.h"

/* q = round(x / d) (ties to even), d = max|x| / 127, so |d q - x| <= d / 2
 * plus a few ulps of x * (1/d): the max|x_b| / 254 term of the error bound. */
static inline float qk_quant_block(int n, const float *x, int8_t *q) {
    float m[8] = {0};
    for (int i = 0; i < n; i += 8)
        for (int k = 0; k < 8; k++) {
            const float a = x[i + k] < 0.0f ? -x[i + k] : x[i + k];
            m[k] = a > m[k] ? a : m[k];
        }
    float amax = 0.0f;
    for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = x[i] * id;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        v = v == v ? v : 0.0f;                      /* NaN */
        v = (v + 12582912.0f) - 12582912.0f;        /* 1.5 * 2^23: round to nearest even */
        q[i] = (int8_t)(int)v;
    }
    return d;
}

/* s: eight partial sums then a fixed tree, so an x passes through at most 6
 * roundings (the error analysis in docs/kernels.md counts them). */
static inline void qk_quant_a32(int n, const float *x, qk_a32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        float p[8];
        for (int k = 0; k < 8; k++) p[k] = x[k];
        for (int i = 8; i < 32; i += 8)
            for (int k = 0; k < 8; k++) p[k] += x[i + k];
        y->s = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
        y->d = qk_quant_block(32, x, y->q);
    }
}

static inline void qk_quant_a256(int n, const float *x, qk_a256 *y) {
    for (int b = 0; b < n / 256; b++, x += 256, y++) {
        y->d = qk_quant_block(256, x, y->q);
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y->q[16 * j + i];
            y->bsums[j] = (int16_t)s;
        }
    }
}

#endif
