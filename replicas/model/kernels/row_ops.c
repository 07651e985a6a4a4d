/* Per-row operations of a decode step that torch runs slowly at decode sizes, on the CPU: each
 * is one pass over a row with no temporaries, where torch makes several passes and allocations
 * (replicas/cpu_row_ops.py has the measurements). Rows are independent: a row's result never
 * depends on the other rows of the batch.
 *
 * argmax():       out[r] = the first index of the largest x[r, :] (torch's rule); rows with a
 *                 NaN: -1 (the caller asks torch, for which NaN is the largest).
 * add_rms_norm(): h[r] += d[r] (rounded to T; skipped when d is NULL), then
 *                 y[r] = w * T(h[r] / sqrt(mean(h[r]^2) + eps)) with the norm in float32:
 *                 Hugging Face's Llama RMSNorm order (normalise in float32, cast, then scale).
 * rope():         rotary embedding of a step's q and k heads (qkv [B, S, nq + 2 nkv, D] as the stacked
 *                 projection returns it; cos, sin [B, S, D] per position): x*cos + rotate_half(x)*sin
 *                 with each product and the sum rounded to T, as torch's three ops round them,
 *                 written as q [B, nq, S, D] and k [B, nkv, S, D], contiguous.
 * Element type T: bfloat16 (uint16 bits) or float32, one function each; arithmetic in float32,
 * every intermediate rounded to T where torch's eager ops round it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float same(float f) { return f; }

#define MAX_H 16384

#define DEFINE(SUFFIX, T, LOAD, STORE, ROUND, BITS_T, KEY_T, KEY, KEY_MIN, KEY_MAX, KEY_INF, KEY_NEG_INF, KEY_ZERO)                                                       \
void argmax_##SUFFIX(const T *x, int64_t stride, int rows, int64_t n, int64_t *out) {              \
    for (int r = 0; r < rows; r++) {                                                              \
        const BITS_T *row = (const BITS_T *)(x + r * stride);                                     \
        /* On integer keys that order as the floats do (KEY), so that both passes vectorise:    \
         * the largest key, then the first block of 64 holding it, then its index there. */       \
        KEY_T lanes[32], lows[32];                                                                \
        for (int l = 0; l < 32; l++) { lanes[l] = KEY_MIN; lows[l] = KEY_MAX; }                   \
        int64_t i = 0;                                                                            \
        for (; i + 32 <= n; i += 32)                                                              \
            for (int l = 0; l < 32; l++) {                                                        \
                KEY_T k = KEY(row[i + l]);                                                        \
                lanes[l] = k > lanes[l] ? k : lanes[l];                                           \
                lows[l] = k < lows[l] ? k : lows[l];                                              \
            }                                                                                     \
        KEY_T best = KEY_MIN, low = KEY_MAX;                                                      \
        for (int l = 0; l < 32; l++) {                                                            \
            best = lanes[l] > best ? lanes[l] : best;                                             \
            low = lows[l] < low ? lows[l] : low;                                                  \
        }                                                                                         \
        for (; i < n; i++) {                                                                      \
            KEY_T k = KEY(row[i]);                                                                \
            best = k > best ? k : best;                                                           \
            low = k < low ? k : low;                                                              \
        }                                                                                         \
        /* NaN (above +inf's key, or below -inf's) and a largest zero (-0 and +0 tie as floats,  \
         * not as keys) are left to torch. */                                                     \
        if (best > KEY_INF || low < KEY_NEG_INF || best == KEY_ZERO) { out[r] = -1; continue; }   \
        int64_t at = 0;                                                                           \
        for (; at + 64 <= n; at += 64) {                                                          \
            int hit = 0;                                                                          \
            for (int l = 0; l < 64; l++) hit |= KEY(row[at + l]) == best;                         \
            if (hit) break;                                                                       \
        }                                                                                         \
        while (at < n && KEY(row[at]) != best) at++;                                              \
        out[r] = at;                                                                              \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
void add_rms_norm_##SUFFIX(T *h, const T *d, const T *w, T *y, int rows, int n, float eps) {      \
    for (int r = 0; r < rows; r++) {                                                              \
        T *hr = h + (int64_t)r * n;                                                               \
        float f[MAX_H];                                                                           \
        if (d != 0) {                                                                             \
            const T *dr = d + (int64_t)r * n;                                                     \
            for (int i = 0; i < n; i++) { hr[i] = STORE(LOAD(hr[i]) + LOAD(dr[i])); }             \
        }                                                                                         \
        float part[16] = {0};                                                                     \
        int i = 0;                                                                                \
        for (; i + 16 <= n; i += 16)                                                              \
            for (int l = 0; l < 16; l++) { f[i + l] = LOAD(hr[i + l]); part[l] += f[i + l] * f[i + l]; }       \
        float ss = 0.f;                                                                           \
        for (; i < n; i++) { f[i] = LOAD(hr[i]); ss += f[i] * f[i]; }                             \
        for (int l = 0; l < 16; l++) ss += part[l];                                               \
        float rstd = 1.f / sqrtf(ss / (float)n + eps);                                            \
        T *yr = y + (int64_t)r * n;                                                               \
        for (int j = 0; j < n; j++) yr[j] = STORE(LOAD(w[j]) * ROUND(f[j] * rstd));               \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* Products rounded on their own, as torch's separate ops round them: no fused multiply-add. */ \
__attribute__((optimize("fp-contract=off")))                                                    \
void rope_##SUFFIX(const T *qkv, const T *cos, const T *sin, T *q, T *k, int B, int S, int nq,    \
                   int nkv, int D) {                                                              \
    int half = D / 2, heads = nq + 2 * nkv;                                                       \
    for (int b = 0; b < B; b++)                                                                   \
        for (int s = 0; s < S; s++) {                                                             \
            const T *c = cos + ((int64_t)b * S + s) * D, *sn = sin + ((int64_t)b * S + s) * D;   \
            for (int h = 0; h < nq + nkv; h++) {                                                  \
                const T *x = qkv + (((int64_t)b * S + s) * heads + h) * D;                        \
                T *out = h < nq ? q + (((int64_t)b * nq + h) * S + s) * D                         \
                                : k + (((int64_t)b * nkv + h - nq) * S + s) * D;                  \
                for (int d = 0; d < D; d++) {                                                     \
                    float rot = d < half ? -LOAD(x[d + half]) : LOAD(x[d - half]);                \
                    out[d] = STORE(ROUND(LOAD(x[d]) * LOAD(c[d])) + ROUND(rot * LOAD(sn[d])));    \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
}

/* A float's bits as a signed integer that orders as the float does: negative floats have their
 * magnitude bits flipped. +0 -> 0, -0 -> -1; +inf -> 0x7f80..., NaN above it (or below -inf's). */
static inline int16_t key16(uint16_t b) { int16_t s = (int16_t)b; return (int16_t)(s ^ ((s >> 15) & 0x7fff)); }
static inline int32_t key32(uint32_t b) { int32_t s = (int32_t)b; return s ^ ((s >> 31) & 0x7fffffff); }

#define ID(x) (x)
DEFINE(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16, uint16_t, int16_t, key16, INT16_MIN, INT16_MAX, 0x7f80, -0x7f81, 0)
DEFINE(f32, float, ID, ID, same, uint32_t, int32_t, key32, INT32_MIN, INT32_MAX, 0x7f800000, -0x7f800001, 0)
