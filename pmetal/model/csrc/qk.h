/* Fused quantized matrix products for GGUF block formats: shared declarations.
 *
 * The weights stay in their GGUF blocks.  Each x row is quantized once per
 * call to the activation format its weight type needs (qk_a32 for Q4_0, Q4_1,
 * Q5_0, Q5_1 and Q8_0; qk_a256, llama.cpp's Q8_K, for the K-quants; plain float32 for
 * F32, F16 and BF16), then every weight row is dotted with it by an integer
 * kernel that applies the block scales inside the dot product.
 *
 * One qk_isa table per instruction set (scalar, AVX2, NEON) holds the dot and
 * dequantize kernels; qk_module.c picks one table at import.  Nothing in the
 * files that implement the tables knows about Python, so tests/model/
 * builds them standalone (an aarch64 cross build run under qemu).
 */
#ifndef PMETAL_QK_H
#define PMETAL_QK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ggml type ids */
enum {
    QK_F32 = 0, QK_F16 = 1, QK_Q4_0 = 2, QK_Q4_1 = 3, QK_Q5_0 = 6, QK_Q5_1 = 7, QK_Q8_0 = 8,
    QK_Q4_K = 12, QK_Q5_K = 13, QK_Q6_K = 14, QK_BF16 = 30,
    QK_NTYPES = 31
};

/* Activation block for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights: q = round(x / d)
 * with d = max|x| / 127, and s = the sum of the original float x of the block
 * (the min term of Q4_1 and Q5_1 is m * s). */
typedef struct { float d; float s; int8_t q[32]; } qk_a32;

/* Activation block for the K-quants (llama.cpp's Q8_K): 256 values,
 * bsums[j] = sum of q[16j .. 16j+15]. */
typedef struct { float d; int8_t q[256]; int16_t bsums[16]; } qk_a256;

enum qk_act { QK_ACT_NONE = 0, QK_ACT_F32, QK_ACT_A32, QK_ACT_A256 };

/* Dot product of one weight row with one prepared x row.  n counts blocks
 * for the quantized types and values for F32, F16 and BF16. */
typedef float (*qk_dot_fn)(int n, const uint8_t *w, const void *x);
/* The same for nr (1..4) x rows at x, x + x_stride, ... into out[0],
 * out[out_stride], ...: the weight row is unpacked once for all of them, and
 * each result has exactly the bits dot would give it.  Optional (NULL: the
 * caller loops over dot). */
typedef void (*qk_dotn_fn)(int n, const uint8_t *w, const void *x, size_t x_stride, int nr,
                           float *out, size_t out_stride);
/* Dequantize n blocks (values for the float types) of one row. */
typedef void (*qk_dequant_fn)(int n, const uint8_t *w, float *out);

typedef void (*qk_quant32_fn)(int n, const float *x, qk_a32 *y);
typedef void (*qk_quant256_fn)(int n, const float *x, qk_a256 *y);

typedef struct {
    const char *name;
    qk_quant32_fn quantize_a32;     /* the same bits in every table */
    qk_quant256_fn quantize_a256;
    qk_dot_fn dot[QK_NTYPES];
    qk_dotn_fn dotn[QK_NTYPES];
    qk_dequant_fn dequant[QK_NTYPES];
} qk_isa;

/* Layout facts: values and bytes per block, 0 for an unsupported type. */
int qk_block_values(int type);
int qk_block_bytes(int type);
enum qk_act qk_act_kind(int type);

/* x rows in the activation formats; n = number of floats (a multiple of 32
 * or 256).  The baseline build; the tables carry their ISA's build of the
 * same code (qk_quant.h), which gives the same bits. */
void qk_quantize_a32(int n, const float *x, qk_a32 *y);
void qk_quantize_a256(int n, const float *x, qk_a256 *y);

void qk_fill_scalar(qk_isa *isa);
#if defined(__x86_64__) || defined(_M_X64)
#define QK_HAVE_X86 1
int qk_cpu_has_avx2(void);
void qk_fill_avx2(qk_isa *isa);
#endif
#if defined(__aarch64__)
#define QK_HAVE_NEON 1
void qk_fill_neon(qk_isa *isa);
#endif

/* Run fn(ctx, i) for i in [0, n) on `threads` threads (the caller is one of
 * them); returns when every item has finished. */
typedef void (*qk_task_fn)(void *ctx, int64_t item);
void qk_parallel(int threads, int64_t n, qk_task_fn fn, void *ctx);

/* ---- small helpers every kernel file uses ---- */

static inline uint16_t qk_u16(const uint8_t *p) {
    uint16_t v; memcpy(&v, p, 2); return v;
}

static inline float qk_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = (float)man * 5.9604644775390625e-8f;  /* man * 2^-24, exact */
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112u) << 23) | (man << 13);
    memcpy(&f, &bits, 4);
    return f;
}

static inline float qk_bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

/* Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit mins in 12 bytes:
 * bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7,
 * bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7
 * (low nibble) and of mins 4-7 (high nibble).  Unpacked four at a time in
 * 32-bit words (GGUF and every target here are little-endian). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "the kernels read GGUF's little-endian blocks with native loads"
#endif
/* Q5_0 and Q5_1 keep the fifth bit of their 32 values in one little-endian
 * uint32 (bit j for value j), after the fp16 scale (and min). */
static inline uint32_t qk_u32(const uint8_t *p) {
    uint32_t v; memcpy(&v, p, 4); return v;
}

static inline void qk_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t w[3], o[4];
    memcpy(w, s, 12);
    o[0] = w[0] & 0x3f3f3f3fu;
    o[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    o[2] = w[1] & 0x3f3f3f3fu;
    o[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, o, 8);
    memcpy(mn, o + 2, 8);
}

#endif
