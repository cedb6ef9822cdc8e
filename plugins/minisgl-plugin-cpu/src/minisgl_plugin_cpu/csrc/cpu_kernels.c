/* minisgl's native CPU kernels (float32), built on first use by minisgl.kernel.cpu.
 *
 * Plain C11 with GCC/Clang vector extensions: the compiler maps the 8-float vectors
 * to whatever the build machine has (-march=native), so there are no intrinsics and
 * no per-ISA variants. OpenMP splits the work across the threads the caller asks for;
 * loaded into a process that already holds PyTorch, it shares PyTorch's OpenMP runtime.
 *
 * Every function takes raw pointers and element strides; the Python side checks
 * dtypes, shapes and contiguity before calling.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

int minisgl_abi_version(void) { return 1; }

/* ------------------------------------------------------------------ GEMM
 * Y[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]) for the few rows of a decode batch:
 * Y = X W^T with W in its stored [N, K] layout, X and Y row-major.
 *
 * Both operands are read along k. A tile of 3 rows of W and 4 rows of X keeps its 12
 * vector accumulators in registers (7 loads feed 12 multiply-adds per step of 8 along
 * k) and sums each across its lanes once at the end. Threads take disjoint runs of W
 * rows, so W (the bulk of the bytes at few rows) streams from memory once per call.
 * With few rows this runs at memory speed, where MKL's small-M GEMM on 2 threads
 * reaches about half of it; from ~24 rows on MKL is as fast and the caller uses it.
 */
#define GEMM_NR 3
#define GEMM_MR 4

static inline __attribute__((always_inline)) void gemm_tile(int nr, int mr, int64_t K, const float *W, int64_t ldw,
                                                           const float *X, int64_t ldx, float *Y, int64_t ldy,
                                                           const float *bias) {
    v8f acc[GEMM_NR][GEMM_MR];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mr; j++) acc[i][j] = splat8(0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        v8f w[GEMM_NR], x[GEMM_MR];
        for (int i = 0; i < nr; i++) w[i] = load8(W + i * ldw + k);
        for (int j = 0; j < mr; j++) x[j] = load8(X + j * ldx + k);
        for (int j = 0; j < mr; j++)
            for (int i = 0; i < nr; i++) acc[i][j] += w[i] * x[j];
    }
    for (int j = 0; j < mr; j++)
        for (int i = 0; i < nr; i++) {
            float s = hsum8(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += W[i * ldw + t] * X[j * ldx + t];
            Y[j * ldy + i] = bias ? s + bias[i] : s;
        }
}

typedef void (*gemm_tile_fn)(int64_t, const float *, int64_t, const float *, int64_t, float *, int64_t,
                             const float *);

#define GEMM_TILE_FN(NR, MR)                                                                                 \
    static void gemm_tile_##NR##_##MR(int64_t K, const float *W, int64_t ldw, const float *X, int64_t ldx, \
                                      float *Y, int64_t ldy, const float *bias) {                            \
        gemm_tile(NR, MR, K, W, ldw, X, ldx, Y, ldy, bias);                                                  \
    }
GEMM_TILE_FN(3, 1)
GEMM_TILE_FN(3, 2)
GEMM_TILE_FN(3, 3)
GEMM_TILE_FN(3, 4)
GEMM_TILE_FN(1, 1)
GEMM_TILE_FN(1, 2)
GEMM_TILE_FN(1, 3)
GEMM_TILE_FN(1, 4)

void minisgl_gemm_nt(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx, const float *W, int64_t ldw,
                     const float *bias, float *Y, int64_t ldy, int nthreads) {
    static const gemm_tile_fn tiles3[GEMM_MR + 1] = {0, gemm_tile_3_1, gemm_tile_3_2, gemm_tile_3_3, gemm_tile_3_4};
    static const gemm_tile_fn tiles1[GEMM_MR + 1] = {0, gemm_tile_1_1, gemm_tile_1_2, gemm_tile_1_3, gemm_tile_1_4};
    const int64_t full = N / GEMM_NR, items = full + (N % GEMM_NR); /* 3-row tiles, then single rows */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int single = item >= full;
        const int64_t n = single ? full * GEMM_NR + (item - full) : item * GEMM_NR;
        const gemm_tile_fn *tiles = single ? tiles1 : tiles3;
        for (int64_t m = 0; m < M; m += GEMM_MR) {
            const int64_t mr = M - m < GEMM_MR ? M - m : GEMM_MR;
            tiles[mr](K, W + n * ldw, ldw, X + m * ldx, ldx, Y + m * ldy + n, ldy, bias ? bias + n : 0);
        }
    }
}

/* ------------------------------------------------------------------ exp
 * exp(x) for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its Taylor series to r^7 (truncation error below 1e-8,
 * under float rounding), times 2^n built in the exponent bits. Inputs below -87
 * give 0.
 */
static inline v8f exp8_nonpositive(v8f x) {
    const v8f log2e = splat8(1.44269504088896341f);
    const v8f ln2_hi = splat8(0.693359375f);
    const v8f ln2_lo = splat8(-2.12194440e-4f);
    const v8f round_magic = splat8(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v8i underflow = x < splat8(-87.0f);
    v8f t = x * log2e + round_magic;
    v8f n = t - round_magic;
    v8f r = (x - n * ln2_hi) - n * ln2_lo;
    v8f p = splat8(1.0f / 5040.0f);
    p = p * r + splat8(1.0f / 720.0f);
    p = p * r + splat8(1.0f / 120.0f);
    p = p * r + splat8(1.0f / 24.0f);
    p = p * r + splat8(1.0f / 6.0f);
    p = p * r + splat8(0.5f);
    p = p * r + splat8(1.0f);
    p = p * r + splat8(1.0f);
    v8i ni = __builtin_convertvector(n, v8i);
    v8i bits = (v8i)p + (ni << 23);
    bits &= ~underflow;
    return (v8f)bits;
}

static inline float exp_nonpositive(float x) {
    v8f v = exp8_nonpositive(splat8(x));
    return v[0];
}

/* -------------------------------------------------------- decode attention
 * One new query token per request against that request's cached K/V, read in place
 * from the paged pool: slot table[rows[b] * table_stride + t] holds position t of
 * request b. Work items are (request, KV head) pairs; the G = Hq / Hkv query heads
 * sharing a KV head are done together, so each K and V row comes from memory once.
 *
 * Pass 1 computes the scores of all positions, pass 2 the softmax weights, pass 3
 * sums the weighted V rows: two reads of the request's KV, no gathered copy. When
 * head_dim is a multiple of 8, scores are made 8 positions at a time (one horizontal
 * reduction for 8 dot products) and the output is accumulated in registers, 64
 * elements of head_dim at a time.
 */
static inline float dot(const float *a, const float *b, int64_t D) {
    int64_t d = 0;
    float s = 0.0f;
    if (D >= 8) {
        v8f acc = splat8(0.0f);
        for (; d + 8 <= D; d += 8) acc += load8(a + d) * load8(b + d);
        s = hsum8(acc);
    }
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* The eight horizontal sums of a[0..7], as one vector. */
static inline v8f hsum8x8(const v8f a[8]) {
    v8f t0 = __builtin_shufflevector(a[0], a[1], 0, 8, 1, 9, 4, 12, 5, 13) +
             __builtin_shufflevector(a[0], a[1], 2, 10, 3, 11, 6, 14, 7, 15);
    v8f t1 = __builtin_shufflevector(a[2], a[3], 0, 8, 1, 9, 4, 12, 5, 13) +
             __builtin_shufflevector(a[2], a[3], 2, 10, 3, 11, 6, 14, 7, 15);
    v8f t2 = __builtin_shufflevector(a[4], a[5], 0, 8, 1, 9, 4, 12, 5, 13) +
             __builtin_shufflevector(a[4], a[5], 2, 10, 3, 11, 6, 14, 7, 15);
    v8f t3 = __builtin_shufflevector(a[6], a[7], 0, 8, 1, 9, 4, 12, 5, 13) +
             __builtin_shufflevector(a[6], a[7], 2, 10, 3, 11, 6, 14, 7, 15);
    /* t0 = [a0 a1 a0 a1 | a0 a1 a0 a1] partial sums (low half: lanes 0-3, high half: 4-7). */
    v8f u0 = __builtin_shufflevector(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    v8f u1 = __builtin_shufflevector(t2, t3, 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(t2, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    /* u0 = [a0 a1 a2 a3 | a0 a1 a2 a3] (sums of lanes 0-3 | of lanes 4-7). */
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* scores[t] = dot(q, K row of position t) for t in [0, len), D a multiple of 8. */
static void scores_blocked(int64_t len, int64_t D, const float *q, const float *k_cache, int64_t slot_stride,
                           int64_t head_off, const int32_t *slots, float *scores) {
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const float *kr[8];
        v8f acc[8];
        for (int j = 0; j < 8; j++) {
            kr[j] = k_cache + (int64_t)slots[t + j] * slot_stride + head_off;
            acc[j] = splat8(0.0f);
        }
        for (int64_t d = 0; d < D; d += 8) {
            v8f qv = load8(q + d);
            for (int j = 0; j < 8; j++) acc[j] += qv * load8(kr[j] + d);
        }
        store8(scores + t, hsum8x8(acc));
    }
    for (; t < len; t++) scores[t] = dot(q, k_cache + (int64_t)slots[t] * slot_stride + head_off, D);
}

/* out[0, W) = sum_t p[t] * V row of position t, columns [0, W) of the head, W <= 64 and a multiple of 8. */
static void weighted_sum_blocked(int64_t len, int64_t W, const float *p, const float *v_cache, int64_t slot_stride,
                                 int64_t head_off, const int32_t *slots, float *out) {
    v8f acc[8];
    const int nv = (int)(W / 8);
    for (int i = 0; i < 8; i++) acc[i] = splat8(0.0f);
    if (nv == 8) { /* the common case, fully unrolled: head_dim 64, 128, 256 */
        for (int64_t t = 0; t < len; t++) {
            const float *vr = v_cache + (int64_t)slots[t] * slot_stride + head_off;
            v8f pv = splat8(p[t]);
            for (int i = 0; i < 8; i++) acc[i] += pv * load8(vr + 8 * i);
        }
    } else {
        for (int64_t t = 0; t < len; t++) {
            const float *vr = v_cache + (int64_t)slots[t] * slot_stride + head_off;
            v8f pv = splat8(p[t]);
            for (int i = 0; i < nv; i++) acc[i] += pv * load8(vr + 8 * i);
        }
    }
    for (int i = 0; i < nv; i++) store8(out + 8 * i, acc[i]);
}

static void softmax_inplace(float *s, int64_t len) {
    float mx = s[0];
    for (int64_t t = 1; t < len; t++) mx = s[t] > mx ? s[t] : mx;
    v8f vsum = splat8(0.0f);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        v8f e = exp8_nonpositive(load8(s + t) - splat8(mx));
        store8(s + t, e);
        vsum += e;
    }
    float sum = hsum8(vsum);
    for (; t < len; t++) {
        s[t] = exp_nonpositive(s[t] - mx);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < len; t++) s[t] *= inv;
}

/* Attention of request b's query heads [h0 * G, h1 * G) (KV heads [h0, h1)); buf holds G * (len + D) floats. */
static void decode_attention_heads(int64_t b, int64_t h0, int64_t h1, int64_t G, int64_t D, const float *q,
                                   int64_t q_stride_b, int64_t q_stride_h, const float *k_cache,
                                   const float *v_cache, int64_t slot_stride, const int32_t *slots, int64_t len,
                                   float scale, float *out, float *buf) {
    const int blocked = D % 8 == 0;
    float *scores = buf, *qs = buf + G * len; /* qs: the G query rows of one KV head, pre-scaled */
    for (int64_t h = h0; h < h1; h++) {
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + b * q_stride_b + (h * G + g) * q_stride_h;
            for (int64_t d = 0; d < D; d++) qs[g * D + d] = qg[d] * scale;
        }
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * len;
            if (blocked)
                scores_blocked(len, D, qs + g * D, k_cache, slot_stride, h * D, slots, s);
            else
                for (int64_t t = 0; t < len; t++)
                    s[t] = dot(qs + g * D, k_cache + (int64_t)slots[t] * slot_stride + h * D, D);
            softmax_inplace(s, len);
        }
        for (int64_t g = 0; g < G; g++) {
            const float *p = scores + g * len;
            float *o = out + (h * G + g) * D;
            if (blocked) {
                for (int64_t d0 = 0; d0 < D; d0 += 64)
                    weighted_sum_blocked(len, D - d0 < 64 ? D - d0 : 64, p, v_cache, slot_stride, h * D + d0, slots,
                                         o + d0);
                continue;
            }
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int64_t t = 0; t < len; t++) {
                const float *vr = v_cache + (int64_t)slots[t] * slot_stride + h * D;
                for (int64_t d = 0; d < D; d++) o[d] += p[t] * vr[d];
            }
        }
    }
}

int minisgl_decode_attention(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, const float *q, int64_t q_stride_b,
                             int64_t q_stride_h, const float *k_cache, const float *v_cache, int64_t slot_stride,
                             const int32_t *table, int64_t table_stride, const int64_t *rows, const int64_t *lens,
                             float scale, float *out, int64_t out_stride_b, int nthreads) {
    const int64_t G = Hq / Hkv;
    /* A work item is a request's KV heads [h0, h0 + per): all of them when there are enough
     * requests to keep the threads busy (each K/V slot row is then read whole, once), one
     * each otherwise. */
    const int64_t per = B >= 4 * (int64_t)nthreads ? Hkv : 1;
    const int64_t items_per_req = Hkv / per;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t item = 0; item < B * items_per_req; item++) {
        const int64_t b = item / items_per_req, h0 = (item % items_per_req) * per;
        const int64_t len = lens[b];
        float *buf = malloc(sizeof(float) * (size_t)(G * (len + D)));
        if (!buf) {
            failed = 1;
            continue;
        }
        decode_attention_heads(b, h0, h0 + per, G, D, q, q_stride_b, q_stride_h, k_cache, v_cache, slot_stride,
                               table + rows[b] * table_stride, len, scale, out + b * out_stride_b, buf);
        free(buf);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ RMSNorm
 * out[m, :] = (x[m, :] (+ residual[m, :])) * rsqrt(mean of squares + eps) * weight,
 * and, with a residual, res_out[m, :] = x[m, :] + residual[m, :]. x may be row-major
 * or column-major (a weight-major GEMM leaves its result column-major); outputs and
 * the residual are row-major with row stride N.
 */
static void rmsnorm_row(int64_t N, const float *x, int64_t cs, const float *residual, const float *weight, float eps,
                        float *out, float *res_out) {
    float *src = res_out ? res_out : out; /* the summed row is written first, then normalised */
    v8f acc = splat8(0.0f);
    int64_t n = 0;
    if (cs == 1) {
        for (; n + 8 <= N; n += 8) {
            v8f v = load8(x + n);
            if (residual) v += load8(residual + n);
            store8(src + n, v);
            acc += v * v;
        }
    }
    float ss = hsum8(acc);
    for (; n < N; n++) {
        float v = x[n * cs] + (residual ? residual[n] : 0.0f);
        src[n] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)N + eps);
    const v8f vinv = splat8(inv);
    for (n = 0; n + 8 <= N; n += 8) store8(out + n, load8(src + n) * vinv * load8(weight + n));
    for (; n < N; n++) out[n] = src[n] * inv * weight[n];
}

void minisgl_rmsnorm(int64_t M, int64_t N, const float *x, int64_t rs, int64_t cs, const float *residual,
                     const float *weight, float eps, float *out, float *res_out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N >= 32768)
    for (int64_t m = 0; m < M; m++)
        rmsnorm_row(N, x + m * rs, cs, residual ? residual + m * N : 0, weight, eps, out + m * N,
                    res_out ? res_out + m * N : 0);
}

/* ------------------------------------------------------------------ SiLU * up
 * out[m, n] = silu(gu[m, n]) * gu[m, N + n] (gate and up halves of one GEMM output).
 * Row-major gu gives a row-major out (row stride N); column-major gu (rs == 1, the
 * weight-major GEMM's layout) a column-major out (column stride M), so both sides
 * are read and written 8 contiguous floats at a time.
 */
static inline v8f silu8(v8f x) {
    /* sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e) below. */
    v8i neg = x < splat8(0.0f);
    v8f ax = (v8f)((v8i)x & ~(v8i)splat8(-0.0f));
    v8f e = exp8_nonpositive(-ax);
    v8f one = splat8(1.0f);
    v8f num = (v8f)(((v8i)e & neg) | ((v8i)one & ~neg));
    return x * num / (one + e);
}

static inline float silu1(float x) { return silu8(splat8(x))[0]; }

void minisgl_silu_mul(int64_t M, int64_t N, const float *gu, int64_t rs, int64_t cs, float *out, int nthreads) {
    if (rs == 1 && M > 1) {
        const int64_t blocks = M / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N >= 32768)
        for (int64_t n = 0; n < N; n++) {
            const float *g = gu + n * cs, *u = gu + (N + n) * cs;
            float *o = out + n * M;
            for (int64_t b = 0; b < blocks; b++) store8(o + 8 * b, silu8(load8(g + 8 * b)) * load8(u + 8 * b));
            for (int64_t m = blocks * 8; m < M; m++) o[m] = silu1(g[m]) * u[m];
        }
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * rs, *u = g + N * cs;
        float *o = out + m * N;
        int64_t n = 0;
        if (cs == 1)
            for (; n + 8 <= N; n += 8) store8(o + n, silu8(load8(g + n)) * load8(u + n));
        for (; n < N; n++) o[n] = silu1(g[n * cs]) * u[n * cs];
    }
}

/* ------------------------------------------------------------------ rope
 * Rotate-half rotary embedding of q and k (optionally RMS-normalised per head first,
 * as Qwen3 does), read from a strided [T, heads, D] view and written contiguous.
 * cos_sin[pos] holds D/2 cosines then D/2 sines. Element (t, h, d) of an input is at
 * base + t * ts + (h * D + d) * cs.
 */
static void rope_head(int64_t D, const float *x, int64_t cs, const float *norm_w, float eps, const float *cs_row,
                      float *out) {
    const int64_t half = D / 2;
    float buf[1024];
    float *v = D <= 1024 ? buf : out; /* head_dim > 1024: normalise in place in out */
    for (int64_t d = 0; d < D; d++) v[d] = x[d * cs];
    if (norm_w) {
        float ss = 0.0f;
        for (int64_t d = 0; d < D; d++) ss += v[d] * v[d];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < D; d++) v[d] = v[d] * inv * norm_w[d];
    }
    const float *cosv = cs_row, *sinv = cs_row + half;
    if (v == out) {
        for (int64_t d = 0; d < half; d++) {
            float a = v[d], b = v[d + half];
            out[d] = a * cosv[d] - b * sinv[d];
            out[d + half] = b * cosv[d] + a * sinv[d];
        }
        return;
    }
    for (int64_t d = 0; d < half; d++) {
        out[d] = v[d] * cosv[d] - v[d + half] * sinv[d];
        out[d + half] = v[d + half] * cosv[d] + v[d] * sinv[d];
    }
}

void minisgl_rope(int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *q, int64_t q_ts, const float *k,
                  int64_t k_ts, int64_t cs, const int64_t *positions, const float *cos_sin, const float *q_norm_w,
                  const float *k_norm_w, float eps, float *q_out, float *k_out, int nthreads) {
    const int64_t H = Hq + Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H * D >= 32768)
    for (int64_t i = 0; i < T * H; i++) {
        const int64_t t = i / H, h = i % H;
        const float *row = cos_sin + positions[t] * D;
        if (h < Hq)
            rope_head(D, q + t * q_ts + h * D * cs, cs, q_norm_w, eps, row, q_out + (t * Hq + h) * D);
        else
            rope_head(D, k + t * k_ts + (h - Hq) * D * cs, cs, k_norm_w, eps, row, k_out + (t * Hkv + h - Hq) * D);
    }
}

/* ------------------------------------------------------------------ KV store
 * k_cache[loc[t], :] = k[t, :] and the same for v, one layer: k and v rows of W floats
 * at (row stride, element stride) each, cache rows contiguous.
 */
static inline void copy_row(float *dst, const float *src, int64_t W, int64_t cs) {
    if (cs == 1) {
        memcpy(dst, src, sizeof(float) * (size_t)W);
        return;
    }
    for (int64_t w = 0; w < W; w++) dst[w] = src[w * cs];
}

void minisgl_store_kv(int64_t T, int64_t W, const float *k, int64_t k_rs, int64_t k_cs, const float *v, int64_t v_rs,
                      int64_t v_cs, const int64_t *loc, float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < T; t++) {
        copy_row(k_cache + loc[t] * W, k + t * k_rs, W, k_cs);
        copy_row(v_cache + loc[t] * W, v + t * v_rs, W, v_cs);
    }
}

/* ------------------------------------------------------------------ argmax
 * out[m] = the first index of the largest value of row m, as torch.argmax gives it
 * (a row with NaN: the index of its first NaN). Eight lanes keep their own first
 * maximum: along the row when rows are contiguous, across 8 rows at once when the
 * matrix is column-major (the LM head's weight-major output). Rows holding a NaN are
 * rescanned one element at a time.
 */
static int64_t argmax_scalar(int64_t N, const float *r, int64_t cs) {
    float best = r[0];
    int64_t arg = 0;
    if (best != best) return 0;
    for (int64_t n = 1; n < N; n++) {
        float v = r[n * cs];
        if (v != v) return n;
        if (v > best) {
            best = v;
            arg = n;
        }
    }
    return arg;
}

static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }
static inline v8i selecti8(v8i mask, v8i a, v8i b) { return (a & mask) | (b & ~mask); }

static int64_t argmax_row_contiguous(int64_t N, const float *r) {
    if (N < 16 || N > INT32_MAX) return argmax_scalar(N, r, 1);
    v8f best = load8(r);
    v8i arg = {0, 1, 2, 3, 4, 5, 6, 7}, idx = arg;
    v8i nan = best != best;
    int64_t n = 8;
    for (; n + 8 <= N; n += 8) {
        v8f v = load8(r + n);
        idx += 8;
        v8i gt = v > best;
        nan |= v != v;
        best = select8(gt, v, best);
        arg = selecti8(gt, idx, arg);
    }
    for (int l = 0; l < 8; l++)
        if (nan[l]) return argmax_scalar(N, r, 1);
    float bv = best[0];
    int64_t ba = arg[0];
    for (int l = 1; l < 8; l++)
        if (best[l] > bv || (best[l] == bv && arg[l] < ba)) {
            bv = best[l];
            ba = arg[l];
        }
    for (; n < N; n++) {
        if (r[n] != r[n]) return argmax_scalar(N, r, 1);
        if (r[n] > bv) {
            bv = r[n];
            ba = n;
        }
    }
    return ba;
}

/* Rows m0..m0+7 of a column-major matrix (element (m, n) at m + n * cs). */
static void argmax_8_columns(int64_t N, const float *x, int64_t cs, int64_t *out) {
    v8f best = load8(x);
    v8i arg = {0}, idx = {0};
    v8i nan = best != best;
    for (int64_t n = 1; n < N; n++) {
        v8f v = load8(x + n * cs);
        idx += 1;
        v8i gt = v > best;
        nan |= v != v;
        best = select8(gt, v, best);
        arg = selecti8(gt, idx, arg);
    }
    for (int l = 0; l < 8; l++) out[l] = nan[l] ? argmax_scalar(N, x + l, cs) : arg[l];
}

void minisgl_argmax_rows(int64_t M, int64_t N, const float *x, int64_t rs, int64_t cs, int64_t *out, int nthreads) {
    if (rs == 1 && cs >= M && N <= INT32_MAX) {
        int64_t blocks = M / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < blocks; b++) argmax_8_columns(N, x + b * 8, cs, out + b * 8);
        for (int64_t m = blocks * 8; m < M; m++) out[m] = argmax_scalar(N, x + m, cs);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++)
        out[m] = cs == 1 ? argmax_row_contiguous(N, x + m * rs) : argmax_scalar(N, x + m * rs, cs);
}
