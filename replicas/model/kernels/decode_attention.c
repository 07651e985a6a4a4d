/* Attention of a few new tokens per sequence over each sequence's own cached keys and values,
 * on the CPU: the two products of a verify step's attention, reading each cached key and value
 * once and only up to the sequence's own length.
 *
 * Why (replicas/cpu_attention.py has the measurements): with 16 sequences of a few hundred
 * cached positions, torch's batched products of 3-row query blocks with the cache's views ran at
 * a fraction of memory speed, after a copy of every view, and over the longest sequence's length
 * for all.
 *
 * The step's tokens are flat (ragged): sequence i is tokens start..start+count-1 of the step, it
 * lives in cache slot ``slot`` and has ``cached`` positions before them; seq[i] = {slot, start,
 * count, cached}. Its keys are positions 0..cached+count-1 of its slot (the new tokens' keys are
 * written first, kv_write). Every cached position is visible to every new token; among the new
 * tokens, token j sees position cached+c iff mask[j, c] == 0 (its chain or tree ancestors; -inf
 * elsewhere).
 *
 * scores(): s[j, hq, t] = scale * q[hq, j] . k[slot, hq / group, t] + (t < cached ? 0 : mask[j, t - cached])
 *           for t < cached + count (-inf beyond, up to L), float32; softmax is torch's, between
 *           the two calls.
 * mix():    o[j, hq] = sum_t p[j, hq, t] v[slot, hq / group, t], accumulated in float32.
 * q: [nq, ntok, D] contiguous; o: [ntok, nq, D] contiguous (what the output projection takes);
 * k, v: the slot buffers [slots, nkv, capacity, D], any strides but a contiguous last dimension;
 * mask: [ntok, W] float32; s, p: [ntok, nq, L] float32. Element type bfloat16 (uint16 bits) or
 * float32, one function each. Each sequence is computed on its own: its numbers do not depend on
 * the rest of the step.
 *
 * kv_write(): new keys (or values) into the slot cache: states [B, H, S, D] (any strides,
 *           contiguous last dimension) to cache[slot[b, s], h, col[b, s]], for any element
 *           size. torch's indexed assignment took ~20 us a call at decode sizes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_D 256
#define MAX_ROWS 256   /* query rows per kv head: group * count */
#define TB 16          /* positions per block of the scores */

#define DEFINE(SUFFIX, T, LOAD, STORE)                                                              \
void scores_##SUFFIX(const T *q, const T *k, int64_t kb, int64_t kh, int64_t kt, const float *mask,  \
                     int W, const int64_t *seq, float *s, int N, int nq, int nkv, int ntok, int D,    \
                     int L, float scale, int threads) {                                               \
    int group = nq / nkv;                                                                             \
    _Pragma("omp parallel for num_threads(threads) if(threads > 1) schedule(static)")                 \
    for (int bh = 0; bh < N * nkv; bh++) {                                                            \
        int b = bh / nkv, h = bh % nkv;                                                               \
        int64_t slot = seq[4 * b], start = seq[4 * b + 1], cached = seq[4 * b + 3];                   \
        int count = (int)seq[4 * b + 2], rows = group * count;                                        \
        float qf[MAX_ROWS][MAX_D];                                                                    \
        for (int g = 0; g < group; g++)                                                               \
            for (int r = 0; r < count; r++) {                                                         \
                const T *src = q + ((int64_t)(h * group + g) * ntok + start + r) * D;                 \
                for (int d = 0; d < D; d++) qf[g * count + r][d] = LOAD(src[d]) * scale;              \
            }                                                                                         \
        int64_t n = cached + count < L ? cached + count : L;                                          \
        const T *kp = k + slot * kb + h * kh;                                                         \
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
                int64_t token = start + row % count;                                                  \
                float *dst = s + (token * nq + h * group + row / count) * L + t0;                     \
                const float *m = mask + token * W;   /* m[t - cached] for t >= cached */             \
                for (int i = 0; i < tb; i++) {                                                        \
                    float acc = 0.f;                                                                  \
                    for (int l = 0; l < 16; l++) acc += part[i][l];                                   \
                    dst[i] = acc + (t0 + i < cached ? 0.f : m[t0 + i - cached]);                      \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int row = 0; row < rows; row++) {                                                        \
            float *dst = s + ((start + row % count) * nq + h * group + row / count) * L;              \
            for (int64_t t = n; t < L; t++) dst[t] = -INFINITY;                                       \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
void mix_##SUFFIX(const float *p, const T *v, int64_t vb, int64_t vh, int64_t vt, const int64_t *seq, \
                  T *o, int N, int nq, int nkv, int D, int L, int threads) {                          \
    int group = nq / nkv;                                                                             \
    _Pragma("omp parallel for num_threads(threads) if(threads > 1) schedule(static)")                 \
    for (int bh = 0; bh < N * nkv; bh++) {                                                            \
        int b = bh / nkv, h = bh % nkv;                                                               \
        int64_t slot = seq[4 * b], start = seq[4 * b + 1], cached = seq[4 * b + 3];                   \
        int count = (int)seq[4 * b + 2], rows = group * count;                                        \
        float acc[MAX_ROWS][MAX_D];                                                                   \
        memset(acc, 0, sizeof(float) * rows * MAX_D);                                                 \
        int64_t n = cached + count < L ? cached + count : L;                                          \
        const T *vp = v + slot * vb + h * vh;                                                         \
        for (int64_t t = 0; t < n; t++) {                                                             \
            float vf[MAX_D];                                                                          \
            const T *vr = vp + t * vt;                                                                \
            for (int d = 0; d < D; d++) vf[d] = LOAD(vr[d]);                                          \
            for (int row = 0; row < rows; row++) {                                                    \
                float w = p[((start + row % count) * nq + h * group + row / count) * L + t];          \
                for (int d = 0; d < D; d++) acc[row][d] += w * vf[d];                                 \
            }                                                                                         \
        }                                                                                             \
        for (int row = 0; row < rows; row++) {                                                        \
            T *dst = o + ((start + row % count) * nq + h * group + row / count) * D;                  \
            for (int d = 0; d < D; d++) dst[d] = STORE(acc[row][d]);                                  \
        }                                                                                             \
    }                                                                                                 \
}

void kv_write(char *cache, int64_t c0, int64_t c1, int64_t c2, const char *src, int64_t s0, int64_t s1,
              int64_t s2, const int64_t *slot, const int64_t *col, int B, int H, int S, int D, int elem) {
    /* strides in elements */
    for (int b = 0; b < B; b++)
        for (int s = 0; s < S; s++) {
            int64_t at = (int64_t)b * S + s, c = col[at], sl = slot[at];
            for (int h = 0; h < H; h++)
                memcpy(cache + (sl * c0 + h * c1 + c * c2) * elem,
                       src + ((int64_t)b * s0 + h * s1 + (int64_t)s * s2) * elem, (size_t)D * elem);
        }
}

#define ID(x) (x)
DEFINE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE(f32, float, ID, ID)
