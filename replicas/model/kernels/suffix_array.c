// Suffix-array searches for the suffix draft's cluster index (replicas/drafts/suffix_array.py).
//
// buf: the tokens (int32), sequences separated by -1 and padded with `depth` of them, so that
// buf[order[i] + k] exists for every k < depth; order: the positions sorted by their first
// `depth` tokens (the separator, -1, sorts before every token). A string is a contiguous range of
// order; the functions below find ranges and split them by the next token, with the same results
// as the numpy path they replace (a Python call per token there, one call here).

#include <stdint.h>

// -1, 0, 1: the `len` tokens at `pos` against `pattern`.
static inline int compare(const int32_t *buf, int64_t pos, const int32_t *pattern, int64_t len) {
    for (int64_t k = 0; k < len; k++) {
        int32_t a = buf[pos + k], b = pattern[k];
        if (a != b) return a < b ? -1 : 1;
    }
    return 0;
}

// The range [out[0], out[1]) of order whose positions start with pattern[0..len).
void sa_find(const int32_t *buf, const int32_t *order, int64_t n, const int32_t *pattern, int64_t len,
             int64_t *out) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {   // first position not below the pattern
        int64_t mid = lo + (hi - lo) / 2;
        if (compare(buf, order[mid], pattern, len) < 0) lo = mid + 1; else hi = mid;
    }
    int64_t first = lo;
    hi = n;
    while (lo < hi) {   // first position above it
        int64_t mid = lo + (hi - lo) / 2;
        if (compare(buf, order[mid], pattern, len) <= 0) lo = mid + 1; else hi = mid;
    }
    out[0] = first;
    out[1] = lo;
}

// The first index in [lo, hi) whose token at `offset` is above `token` (the column is sorted there).
static inline int64_t after(const int32_t *buf, const int32_t *order, int64_t lo, int64_t hi, int64_t offset,
                            int32_t token) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (buf[order[mid] + offset] <= token) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// The continuations of the string [lo, hi) of `offset` tokens: its distinct next tokens (the
// separator left out), each with its sub-range [starts, starts + counts), at most `cap` of them,
// in token order; returns how many were written, and the count of every continuation in *total.
int64_t sa_children(const int32_t *buf, const int32_t *order, int64_t lo, int64_t hi, int64_t offset, int64_t cap,
                    int32_t *tokens, int64_t *counts, int64_t *starts, int64_t *total) {
    int64_t written = 0, sum = 0;
    int64_t at = lo;
    while (at < hi) {
        int32_t token = buf[order[at] + offset];
        int64_t end = after(buf, order, at, hi, offset, token);   // a jump per distinct token
        if (token >= 0) {
            sum += end - at;
            if (written < cap) {
                tokens[written] = token;
                counts[written] = end - at;
                starts[written] = at;
                written++;
            }
        }
        at = end;
    }
    *total = sum;
    return written;
}
