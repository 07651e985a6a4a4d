/* Attention of a few new tokens per sequence over each sequence's own cached keys and values,
 * on the CPU: the two products of a verify step's attention, reading each cached key and value
 * once and only up to the sequence's own length.
 *
 * Why (replicas/cpu_attention.py has the measurements): with 16 sequences of a few hundred
 * cached positions, torch's batched products of 3-row query blocks with the cache's views ran at
 * a fraction of memory speed, after a copy of every view, and over the longest sequence's length
 * for all.
 *
 * scores(): s[b, h, r, t] = scale * q[b, h, r] . k[b, h / group, t] + mask[b, r % S, t]  for t < len[b]
 *           (-inf beyond), in float32; softmax is torch's, between the two calls.
 * mix():    o[b, h, r] = sum_t p[b, h, r, t] v[b, h / group, t], accumulated in float32.
 * q, o: [B, nq, S, D] contiguous; k, v: [B, nkv, L, D] with any strides but a contiguous last
 * dimension (views of the slot cache); mask: [B, S, L] float32 contiguous; s, p: [B, nq, S, L]
 * float32 contiguous. Element type: bfloat16 (uint16 bits) or float32, one function each.
 *
 * kv_write(): the step's new keys (or values) into the slot cache: states [B, H, S, D] (any
 *           strides, contiguous last dimension) to cache[first_slot + b, h, col[b, s]], for any
 *           element size. torch's indexed assignment took ~20 us a call at decode sizes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_D 256
#define MAX_ROWS 256   /* query rows per kv head: group * S */
#define TB 16          /* positions per block of the scores */

#define DEFINE(SUFFIX, T, LOAD, STORE)                                                              \
void scores_##SUFFIX(const T *q, const T *k, int64_t kb, int64_t kh, int64_t kt, const float *mask,  \
                     const int64_t *len, float *s, int B, int nq, int nkv, int S, int D, int L,       \
                     float scale, int threads) {                                                      \
    int group = nq / nkv, rows = group * S;                                                           \
    _Pragma("omp parallel for num_threads(threads) if(threads > 1) schedule(static)")                 \
    for (int bh = 0; bh < B * nkv; bh++) {                                                            \
        int b = bh / nkv, h = bh % nkv;                                                               \
        float qf[MAX_ROWS][MAX_D];                                                                    \
        for (int g = 0; g < group; g++)                                                               \
            for (int r = 0; r < S; r++) {                                                             \
                const T *src = q + (((int64_t)b * nq + h * group + g) * S + r) * D;                   \
                for (int d = 0; d < D; d++) qf[g * S + r][d] = LOAD(src[d]) * scale;                  \
            }                                                                                         \
        int64_t n = len[b] < L ? len[b] : L;                                                          \
        float *out = s + ((int64_t)b * nq + h * group) * S * L;   /* rows g*S+r, stride L */          \
        const T *kp = k + b * kb + h * kh;                                                            \
        /* Each (row, t) dot product ends in 16-lane partial sums (part), reduced for a block of   \
         * positions at once, so no horizontal sum is taken per product. */                       \
        for (int64_t t0 = 0; t0 < n; t0 += TB) {                                                      \
            int tb = n - t0 < TB ? (int)(n - t0) : TB;                                                \
            float kf[TB][MAX_D];                                                                      \
            for (int i = 0; i < tb; i++) {                                                            \
                const T *kr = kp + (t0 + i) * kt;                                                     \
                for (int d = 0; d < D; d++) kf[i][d] = LOAD(kr[d]);                                   \
            }                                                                                         \
            for (int row = 0; row < rows; row++) {                                                    \
                float part[TB][16];                                                                   \
                for (int i = 0; i < tb; i++) {                                                        \
                    for (int l = 0; l < 16; l++) part[i][l] = 0.f;                                    \
                    for (int d0 = 0; d0 < D; d0 += 16)                                                \
                        for (int l = 0; l < 16; l++) part[i][l] += qf[row][d0 + l] * kf[i][d0 + l];   \
                }                                                                                     \
                float *dst = out + (int64_t)row * L + t0;                                             \
                const float *m = mask + ((int64_t)b * S + row % S) * L + t0;                          \
                for (int i = 0; i < tb; i++) {                                                        \
                    float acc = 0.f;                                                                  \
                    for (int l = 0; l < 16; l++) acc += part[i][l];                                   \
                    dst[i] = acc + m[i];                                                              \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int row = 0; row < rows; row++)                                                          \
            for (int64_t t = n; t < L; t++) out[(int64_t)row * L + t] = -INFINITY;                    \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
void mix_##SUFFIX(const float *p, const T *v, int64_t vb, int64_t vh, int64_t vt, const int64_t *len, \
                  T *o, int B, int nq, int nkv, int S, int D, int L, int threads) {                   \
    int group = nq / nkv, rows = group * S;                                                           \
    _Pragma("omp parallel for num_threads(threads) if(threads > 1) schedule(static)")                 \
    for (int bh = 0; bh < B * nkv; bh++) {                                                            \
        int b = bh / nkv, h = bh % nkv;                                                               \
        float acc[MAX_ROWS][MAX_D];                                                                   \
        memset(acc, 0, sizeof(float) * rows * MAX_D);                                                 \
        int64_t n = len[b] < L ? len[b] : L;                                                          \
        const float *pp = p + ((int64_t)b * nq + h * group) * S * L;                                  \
        const T *vp = v + b * vb + h * vh;                                                            \
        for (int64_t t = 0; t < n; t++) {                                                             \
            float vf[MAX_D];                                                                          \
            const T *vr = vp + t * vt;                                                                \
            for (int d = 0; d < D; d++) vf[d] = LOAD(vr[d]);                                          \
            for (int row = 0; row < rows; row++) {                                                    \
                float w = pp[(int64_t)row * L + t];                                                   \
                for (int d = 0; d < D; d++) acc[row][d] += w * vf[d];                                 \
            }                                                                                         \
        }                                                                                             \
        for (int g = 0; g < group; g++)                                                               \
            for (int r = 0; r < S; r++) {                                                             \
                T *dst = o + (((int64_t)b * nq + h * group + g) * S + r) * D;                         \
                for (int d = 0; d < D; d++) dst[d] = STORE(acc[g * S + r][d]);                        \
            }                                                                                         \
    }                                                                                                 \
}

void kv_write(char *cache, int64_t c0, int64_t c1, int64_t c2, const char *src, int64_t s0, int64_t s1,
              int64_t s2, int64_t first_slot, const int64_t *col, int B, int H, int S, int D, int elem) {
    /* strides in elements */
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            int64_t c = col[(int64_t)b * S + s];
            for (int h = 0; h < H; h++)
                memcpy(cache + ((first_slot + b) * c0 + h * c1 + c * c2) * elem,
                       src + ((int64_t)b * s0 + h * s1 + (int64_t)s * s2) * elem, (size_t)D * elem);
        }
}

#define ID(x) (x)
DEFINE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE(f32, float, ID, ID)
