/* y = x W^T (+ b) in float32 for the few rows of a decode or verify step, reading W once.
 *
 * x [M, K], W [N, K] (a Linear's weight, rows contiguous), b [N] or NULL, y [M, N] (row stride
 * ldy). Output rows are taken in blocks of ROWS; within a block every weight row is read once
 * from memory and multiplied with each x row of the block while it sits in L1, so a step of up to
 * ROWS rows costs one pass over the weights, as one row does (the BLAS of some CPUs re-reads the
 * weights for each of 2-4 rows: docs/benchmarks.md §3.0 has the measurements).
 *
 * Each y[m, n] is the same fixed-order dot product whatever M is and wherever row m sits, so a
 * row's result never depends on the other rows of the step (batch invariance), nor on the
 * thread count (threads split the N outputs).
 */
#include <stdint.h>

#define ROWS 8

/* The dot products of up to ROWS rows of x with one weight row. Always ROWS chains (rows past the
 * step's repeat its last row, their sums discarded), so that each sum is computed by the same
 * code, in the same order, however many rows the step has; the chains are independent, which
 * also hides the multiply-add latency. */
static inline void dots(const float *const x[ROWS], const float *restrict w, int64_t k, float out[ROWS]) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3], *x4 = x[4], *x5 = x[5], *x6 = x[6], *x7 = x[7];
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
    for (int64_t i = 0; i < k; i++) {
        const float wi = w[i];
        a0 += x0[i] * wi; a1 += x1[i] * wi; a2 += x2[i] * wi; a3 += x3[i] * wi;
        a4 += x4[i] * wi; a5 += x5[i] * wi; a6 += x6[i] * wi; a7 += x7[i] * wi;
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}

void linear_f32(const float *restrict x, int64_t ldx, const float *restrict w, const float *restrict b,
                float *restrict y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    for (int64_t m0 = 0; m0 < m; m0 += ROWS) {
        const int64_t rows = m - m0 < ROWS ? m - m0 : ROWS;
        const float *xs[ROWS];
        for (int r = 0; r < ROWS; r++) xs[r] = x + (m0 + (r < rows ? r : rows - 1)) * ldx;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            float out[ROWS];
            dots(xs, w + j * k, k, out);
            const float bias = b ? b[j] : 0.0f;
            for (int64_t r = 0; r < rows; r++) y[(m0 + r) * ldy + j] = out[r] + bias;
        }
    }
}
