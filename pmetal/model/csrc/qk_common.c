/* Layout facts and activation quantization, shared by every ISA.
 *
 * x is quantized here, in plain C, for every instruction set: the bits of a
 * quantized x row then never depend on the kernel that consumes it.
 */
#include <math.h>

#include "qk.h"

int qk_block_values(int type) {
    switch (type) {
    case QK_F32: case QK_F16: case QK_BF16: return 1;
    case QK_Q4_0: case QK_Q4_1: case QK_Q8_0: return 32;
    case QK_Q4_K: case QK_Q5_K: case QK_Q6_K: return 256;
    default: return 0;
    }
}

int qk_block_bytes(int type) {
    switch (type) {
    case QK_F32: return 4;
    case QK_F16: case QK_BF16: return 2;
    case QK_Q4_0: return 18;
    case QK_Q4_1: return 20;
    case QK_Q8_0: return 34;
    case QK_Q4_K: return 144;
    case QK_Q5_K: return 176;
    case QK_Q6_K: return 210;
    default: return 0;
    }
}

enum qk_act qk_act_kind(int type) {
    switch (type) {
    case QK_F32: case QK_F16: case QK_BF16: return QK_ACT_F32;
    case QK_Q4_0: case QK_Q4_1: case QK_Q8_0: return QK_ACT_A32;
    case QK_Q4_K: case QK_Q5_K: case QK_Q6_K: return QK_ACT_A256;
    default: return QK_ACT_NONE;
    }
}

/* q = round(x / d), d = max|x| / 127, so |d q - x| <= d / 2 (plus a few ulps
 * of x * (1/d)): the source of the max|x_b| / 254 term of the error bound. */
static inline float qk_quant_block(int n, const float *x, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = roundf(x[i] * id);
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)(v == v ? v : 0.0f);
    }
    return d;
}

void qk_quantize_a32(int n, const float *x, qk_a32 *y) {
    for (int b = 0; b < n / 32; b++, x += 32, y++) {
        double s = 0.0;
        for (int i = 0; i < 32; i++) s += x[i];
        y->s = (float)s;
        y->d = qk_quant_block(32, x, y->q);
    }
}

void qk_quantize_a256(int n, const float *x, qk_a256 *y) {
    for (int b = 0; b < n / 256; b++, x += 256, y++) {
        y->d = qk_quant_block(256, x, y->q);
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y->q[16 * j + i];
            y->bsums[j] = (int16_t)s;
        }
    }
}
