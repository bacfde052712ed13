/* Standalone check of one build's vector kernels against its scalar ones.
 *
 * Built without Python by tests/model/test_isa_check.py, natively (AVX2 on
 * x86-64) and cross-compiled for aarch64 and run under qemu (NEON, with and
 * without the dot-product extension).  On random valid blocks of every
 * format it checks that:
 *   - dequantize gives the scalar bits exactly;
 *   - NEON dots on quantized formats give the scalar bits exactly (same
 *     exact integer block sums, same float expression per block);
 *   - every other vector dot is within 2 gamma(D) * sum mag_i (|x_i| + delta_b)
 *     of the scalar one (each is within gamma(D) of the exact value of the
 *     quantized-x product; D = blocks + 8, or ceil(K/8) + 12 for floats);
 *   - the multi-row kernels (dotn, nr = 1..4) give each row exactly the bits
 *     the single-row kernel gives it;
 *   - the table's x quantizers give the baseline quantizers' bits exactly,
 *     for rows of every scale, ties, zeros, NaN and infinities.
 * Prints "ok <isa> <checks>" and exits 0, or the first mismatches and 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "qk.h"

static uint64_t state = 0x9e3779b97f4a7c15ull;

static uint64_t next(void) {
    state ^= state << 13; state ^= state >> 7; state ^= state << 17;
    return state;
}

static double uniform(void) { return (double)(next() >> 11) / 9007199254740992.0; }

/* A normal fp16 with a random mantissa, magnitude in [2^(e-15), 2^(e-14)). */
static uint16_t fp16_bits(int e_lo, int e_hi, int allow_negative) {
    const uint16_t e = (uint16_t)(e_lo + (int)(next() % (uint64_t)(e_hi - e_lo + 1)));
    const uint16_t sign = allow_negative && (next() & 1) ? 0x8000 : 0;
    return (uint16_t)(sign | (e << 10) | (next() & 0x3ff));
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static void random_row(int type, int n, uint8_t *w) {
    const int bb = qk_block_bytes(type);
    for (int i = 0; i < n * bb; i++) w[i] = (uint8_t)next();
    for (int b = 0; b < n; b++) {
        uint8_t *p = w + b * bb;
        switch (type) {
        case QK_F32: { float f = (float)(uniform() * 2 - 1); memcpy(p, &f, 4); break; }
        case QK_F16: put16(p, fp16_bits(13, 15, 1)); break;
        case QK_BF16: put16(p, (uint16_t)((next() & 0x8000) | (uint16_t)(0x3e00 + next() % 0x200))); break;
        case QK_Q4_0: case QK_Q8_0: put16(p, fp16_bits(5, 9, 1)); break;
        case QK_Q5_0: put16(p, fp16_bits(5, 9, 1)); break;
        case QK_Q4_1: case QK_Q5_1: put16(p, fp16_bits(5, 9, 0)); put16(p + 2, fp16_bits(6, 10, 1)); break;
        case QK_Q4_K: case QK_Q5_K: put16(p, fp16_bits(3, 7, 0)); put16(p + 2, fp16_bits(3, 7, 0)); break;
        case QK_Q6_K: put16(p + 208, fp16_bits(3, 7, 1)); break;
        }
    }
}

/* mag_i: the sum of the magnitudes of the scale part and the min part of w_i. */
static void magnitudes(int type, int n, const uint8_t *w, const float *deq, double *mag) {
    const int bv = qk_block_values(type), bb = qk_block_bytes(type);
    for (int b = 0; b < n; b++) {
        const uint8_t *p = w + b * bb;
        for (int i = 0; i < bv; i++) {
            double m = 0.0;
            if (type == QK_Q4_1 || type == QK_Q5_1) m = -qk_fp16_to_fp32(qk_u16(p + 2));
            if (type == QK_Q4_K || type == QK_Q5_K) {
                uint8_t sc[8], mn[8];
                qk_k_scales(p + 4, sc, mn);
                m = (double)qk_fp16_to_fp32(qk_u16(p + 2)) * mn[i / 32];
            }
            mag[b * bv + i] = fabs((double)deq[b * bv + i] + m) + fabs(m);
        }
    }
}

static double gamma_n(int n) { const double u = ldexp(1.0, -24); return n * u / (1 - n * u); }

int main(void) {
    qk_isa scalar, best;
    qk_fill_scalar(&scalar);
    best = scalar;
#if defined(QK_HAVE_X86)
    if (qk_cpu_has_avx2()) qk_fill_avx2(&best);
#endif
#if defined(QK_HAVE_NEON)
    qk_fill_neon(&best);
#endif
    const int neon = !strncmp(best.name, "neon", 4);
    const int types[] = {QK_F32, QK_F16, QK_BF16, QK_Q4_0, QK_Q4_1, QK_Q5_0, QK_Q5_1, QK_Q8_0, QK_Q4_K, QK_Q5_K, QK_Q6_K};
    const int rows = 48, R = 3;
    long checks = 0, failures = 0;
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        const int type = types[t], bv = qk_block_values(type), bb = qk_block_bytes(type);
        const int K = bv == 1 ? 577 : bv == 32 ? 576 : 1536, n = K / bv;
        const enum qk_act act = qk_act_kind(type);
        uint8_t *w = malloc((size_t)n * bb);
        float *x = malloc(sizeof(float) * K), *d1 = malloc(sizeof(float) * K), *d2 = malloc(sizeof(float) * K);
        double *mag = malloc(sizeof(double) * K);
        void *xq = malloc(sizeof(qk_a256) * (K / 256 + 1) + sizeof(qk_a32) * (K / 32 + 1));
        for (int r = 0; r < R; r++) {
            const double scale = r == 1 ? 0.0 : uniform() * 4 + 0.01;
            for (int i = 0; i < K; i++) x[i] = (float)((uniform() * 2 - 1) * scale);
            if (r == 2) x[K / 3] = 40.0f;
            const void *xp = x;
            if (act == QK_ACT_A32) { qk_quantize_a32(K, x, xq); xp = xq; }
            if (act == QK_ACT_A256) { qk_quantize_a256(K, x, xq); xp = xq; }
            for (int row = 0; row < rows; row++) {
                random_row(type, n, w);
                scalar.dequant[type](n, w, d1);
                best.dequant[type](n, w, d2);
                if (memcmp(d1, d2, sizeof(float) * K)) {
                    if (failures++ < 10) printf("dequant differs: type %d row %d\n", type, row);
                }
                const float s = scalar.dot[type](n, w, xp), v = best.dot[type](n, w, xp);
                checks++;
                if (neon && act != QK_ACT_F32) {
                    if (memcmp(&s, &v, 4) && failures++ < 10)
                        printf("type %d row %d x%d: scalar %.9g neon %.9g (must be equal)\n", type, row, r, s, v);
                    continue;
                }
                magnitudes(type, n, w, d1, mag);
                const int per = act == QK_ACT_A256 ? 256 : act == QK_ACT_A32 ? 32 : 1;
                double sum = 0.0;
                for (int b0 = 0; b0 < K; b0 += per) {
                    double amax = 0.0;
                    for (int i = b0; i < b0 + per; i++) amax = fmax(amax, fabs((double)x[i]));
                    const double delta = per == 1 ? 0.0 : amax / 254 * (1 + ldexp(1.0, -14));
                    for (int i = b0; i < b0 + per; i++) sum += mag[i] * (fabs((double)x[i]) + delta);
                }
                const double limit = 2 * gamma_n(per == 1 ? (K + 7) / 8 + 12 : n + 8) * sum;
                if (fabs((double)s - (double)v) > limit && failures++ < 10)
                    printf("type %d row %d x%d: scalar %.9g %s %.9g differ by more than %.3g\n",
                           type, row, r, s, best.name, v, limit);
            }
        }
        if (best.dotn[type]) {   /* multi-row kernels: the single-row bits, exactly */
            const size_t stride = act == QK_ACT_A256 ? sizeof(qk_a256) * (size_t)(K / 256)
                                                     : sizeof(qk_a32) * (size_t)(K / 32);
            uint8_t *x4 = malloc(4 * stride);
            for (int r = 0; r < 4; r++) {
                for (int i = 0; i < K; i++) x[i] = (float)((uniform() * 2 - 1) * (r + 1));
                if (act == QK_ACT_A256) qk_quantize_a256(K, x, (qk_a256 *)(void *)(x4 + r * stride));
                else qk_quantize_a32(K, x, (qk_a32 *)(void *)(x4 + r * stride));
            }
            for (int row = 0; row < rows; row++) {
                random_row(type, n, w);
                for (int nr = 1; nr <= 4; nr++) {
                    float got[8];
                    best.dotn[type](n, w, x4, stride, nr, got, 2);
                    for (int r = 0; r < nr; r++) {
                        const float one = best.dot[type](n, w, x4 + r * stride);
                        checks++;
                        if (memcmp(&one, &got[2 * r], 4) && failures++ < 10)
                            printf("type %d row %d: dotn(nr=%d) row %d gives %.9g, dot %.9g\n",
                                   type, row, nr, r, got[2 * r], one);
                    }
                }
            }
            free(x4);
        }
        free(w); free(x); free(d1); free(d2); free(mag); free(xq);
    }
    {   /* quantizers */
        const int K = 2048;
        float *x = malloc(sizeof(float) * K);
        qk_a32 *a = malloc(sizeof(qk_a32) * (K / 32)), *b = malloc(sizeof(qk_a32) * (K / 32));
        qk_a256 *c = malloc(sizeof(qk_a256) * (K / 256)), *e = malloc(sizeof(qk_a256) * (K / 256));
        for (int rep = 0; rep < 200; rep++) {
            const double scale = ldexp(1.0, (int)(next() % 40) - 20);
            for (int i = 0; i < K; i++) x[i] = (float)((uniform() * 2 - 1) * scale);
            if (rep % 4 == 1) for (int i = 0; i < K; i += 3) x[i] = (float)((int)(next() % 255) - 127) * 0.5f;
            if (rep % 4 == 2) for (int i = 0; i < 64; i++) x[i] = 0.0f;
            if (rep % 4 == 3) { x[5] = NAN; x[300] = INFINITY; x[700] = -INFINITY; }
            memset(a, 0, sizeof(qk_a32) * (K / 32)); memset(b, 0, sizeof(qk_a32) * (K / 32));
            memset(c, 0, sizeof(qk_a256) * (K / 256)); memset(e, 0, sizeof(qk_a256) * (K / 256));
            qk_quantize_a32(K, x, a);
            best.quantize_a32(K, x, b);
            qk_quantize_a256(K, x, c);
            best.quantize_a256(K, x, e);
            checks += 2;
            if (memcmp(a, b, sizeof(qk_a32) * (K / 32)) && failures++ < 10)
                printf("quantize_a32 differs from the baseline (rep %d)\n", rep);
            if (memcmp(c, e, sizeof(qk_a256) * (K / 256)) && failures++ < 10)
                printf("quantize_a256 differs from the baseline (rep %d)\n", rep);
        }
        free(x); free(a); free(b); free(c); free(e);
    }
    if (failures) { printf("FAILED %ld of %ld (%s)\n", failures, checks, best.name); return 1; }
    printf("ok %s %ld\n", best.name, checks);
    return 0;
}
