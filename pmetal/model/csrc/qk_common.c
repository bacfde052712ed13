/* Layout facts, and the baseline build of the activation quantizers. */
#include "qk.h"
#include "qk_quant.h"

int qk_block_values(int type) {
    switch (type) {
    case QK_F32: case QK_F16: case QK_BF16: return 1;
    case QK_Q4_0: case QK_Q4_1: case QK_Q5_0: case QK_Q5_1: case QK_Q8_0: return 32;
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
    case QK_Q5_0: return 22;
    case QK_Q5_1: return 24;
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
    case QK_Q4_0: case QK_Q4_1: case QK_Q5_0: case QK_Q5_1: case QK_Q8_0: return QK_ACT_A32;
    case QK_Q4_K: case QK_Q5_K: case QK_Q6_K: return QK_ACT_A256;
    default: return QK_ACT_NONE;
    }
}

void qk_quantize_a32(int n, const float *x, qk_a32 *y) { qk_quant_a32(n, x, y); }
void qk_quantize_a256(int n, const float *x, qk_a256 *y) { qk_quant_a256(n, x, y); }
