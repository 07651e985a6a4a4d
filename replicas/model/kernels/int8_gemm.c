/* y = (x Q^T) * s (+ b) for the few rows of a draft's step: float32 x, weights stored as int8 rows
 * Q [N, K] with one float32 scale per row (s [N]), so that the weights stream from memory at a
 * quarter of float32's bytes. A small model's step is bound by reading its weights; a draft only
 * proposes, so rounding its weights changes how often it is accepted, never the output.
 *
 * The order of every sum is written out: each dot product runs 8 independent partial sums
 * (lane l takes the positions i with i % 8 == l, in order), added lane 0 to 7 at the end. No
 * reassociation is left to the compiler, so a row's result is the same whether it is computed
 * alone or with up to ROWS others (batch invariance), and whatever the thread count (threads
 * split the N outputs).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS 4

/* Eight lanes as GCC/Clang vector types: lane-wise arithmetic in exactly the order written. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));

static inline v8f load_x(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Eight int8 weights as floats: on x86 one sign-extending load and one conversion (compilers
 * widen a generic int8 vector lane by lane, which made the kernel slower than float32's). */
static inline v8f load_w(const int8_t *p) {
#ifdef __AVX2__
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, v8i), v8f);
#endif
}

static inline float lanes_sum(v8f a) {
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += a[l];
    return s;
}

/* The dot products of C rows of x with one int8 weight row, C = 1..ROWS. A tail of k % 8
 * positions is one more step on zero-padded copies (a zero product leaves a lane's sum as is). */
#define DOTS(C)                                                                                      \
    static inline void dots##C(const float *const x[ROWS], const int8_t *restrict w, int64_t k,      \
                               float out[ROWS]) {                                                   \
        v8f acc[C];                                                                                  \
        for (int c = 0; c < C; c++) acc[c] = (v8f){0};                                             \
        const int64_t body = k - k % 8;                                                             \
        for (int64_t i = 0; i < body; i += 8) {                                                     \
            const v8f wi = load_w(w + i);                                                           \
            for (int c = 0; c < C; c++) acc[c] += load_x(x[c] + i) * wi;                            \
        }                                                                                            \
        if (body < k) {                                                                              \
            int8_t wt[8] = {0};                                                                      \
            memcpy(wt, w + body, (size_t)(k - body));                                               \
            const v8f wi = load_w(wt);                                                               \
            for (int c = 0; c < C; c++) {                                                            \
                float xt[8] = {0};                                                                   \
                memcpy(xt, x[c] + body, (size_t)(k - body) * sizeof(float));                        \
                acc[c] += load_x(xt) * wi;                                                           \
            }                                                                                        \
        }                                                                                            \
        for (int c = 0; c < C; c++) out[c] = lanes_sum(acc[c]);                                     \
    }
DOTS(1)
DOTS(2)
DOTS(3)
DOTS(4)

void linear_i8(const float *restrict x, int64_t ldx, const int8_t *restrict w, const float *restrict scale,
               const float *restrict b, float *restrict y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
        const int64_t rows = m - m0 < ROWS ? m - m0 : ROWS;
        const float *xs[ROWS];
        for (int r = 0; r < ROWS; r++) xs[r] = x + (m0 + (r < rows ? r : rows - 1)) * ldx;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            float out[ROWS];
            const int8_t *row = w + j * k;
            switch (rows) {
                case 1: dots1(xs, row, k, out); break;
                case 2: dots2(xs, row, k, out); break;
                case 3: dots3(xs, row, k, out); break;
                default: dots4(xs, row, k, out); break;
            }
            const float bias = b ? b[j] : 0.0f;
            for (int64_t r = 0; r < rows; r++) y[(m0 + r) * ldy + j] = out[r] * scale[j] + bias;
        }
    }
}
