/* lineside rows: onnxruntime custom op "ai.lineside:MatMulNBits", com.microsoft's 4- or 8-bit MatMulNBits of a
 * decode graph (block 32..256, optional uint8 zero points and bias; activations rounded to int8 per block as
 * accuracy level 4 does) computed so that each weight tile (16 columns, 8 on AVX2) is loaded once for every row of
 * a step.
 *
 * Why: onnxruntime's kernel re-reads and re-scales every 4-bit block per row, so 8 decode rows cost ~2.9x one;
 * here a row costs its dot products only (vpdpbusd on 16 columns at once; on AVX2 vpmaddubsw + vpmaddwd on 8, 4-bit
 * only: 8-bit products would saturate there), and each row's result does not depend on the other rows (8 streams
 * stay identical to sequential runs). Both paths do the same float operations per column, so they agree bit for
 * bit. Built by lineside/runtime/rows_kernel.py with onnxruntime's C API header (Debian's libonnxruntime-dev).
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onnxruntime_c_api.h"

#define ROW_TILE 8
#define GROUP 16                 /* columns per tile on AVX-512: one zmm of int32 / float32 lanes (8 on AVX2) */
#define SUB 32                   /* inputs per code chunk: 8 dwords x 4 inputs */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

enum { ISA_NONE = 0, ISA_AVX2 = 2, ISA_AVX512 = 3, ISA_AVXVNNI = 4 };

static const OrtApi *api;
static int isa;                  /* what this process runs: lineside_rows_isa() */

typedef struct {
  int64_t k, n, block, bits;     /* attributes */
  int64_t width;                 /* columns per group: 16 (AVX-512) or 8 (AVX2, AVX-VNNI) */
  int vnni;                      /* 8-column groups with AVX-VNNI's vpdpbusd (4- and 8-bit) */
  int64_t blocks;                /* ceil(k / block) */
  int64_t groups;                /* ceil(n / width) */
  int64_t subs;                  /* block / 32 */
  size_t code_bytes;             /* one (group, block)'s codes: subs * width * 16 (4 bits) or * 32 (8 bits) */
  uint8_t *packed;               /* codes [groups][blocks][code_bytes], then scales and zeros; 64-byte aligned */
  float *scales;                 /* [groups][blocks][width] */
  uint8_t *zeros;                /* [groups][blocks][width]: as many bytes per weight as onnxruntime's own layout */
  const void *packed_from;       /* the B buffer it was packed from */
  pthread_mutex_t lock;
} RowsOp;

typedef struct {                 /* one call's activations, rounded per block */
  int64_t rows, stride;          /* stride: blocks * block bytes per row */
  int8_t *q;                     /* rows * stride */
  float *scale;                  /* rows * blocks: the block's step */
  float *zsum;                   /* rows * blocks: step * sum of the block's codes (the zero point's term) */
} Acts;

typedef struct {
  const RowsOp *op;
  const Acts *acts;
  const float *bias;
  float *y;
  int64_t groups_per_task;
} Work;

static OrtStatus *fail(const char *msg) { return api->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

/* An input of exactly `count` elements, as K, N, the block and the bits say (a different one is an error, not a
   read past its end). */
static OrtStatus *expect_count(const OrtValue *value, int64_t count, const char *name) {
  OrtTensorTypeAndShapeInfo *info;
  size_t got = 0;
  OrtStatus *st = api->GetTensorTypeAndShape(value, &info);
  if (st) return st;
  st = api->GetTensorShapeElementCount(info, &got);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (st) return st;
  if ((int64_t)got != count) {
    char msg[160];
    snprintf(msg, sizeof(msg), "lineside rows: %s holds %zu elements, K, N and the block ask for %lld", name, got,
             (long long)count);
    return fail(msg);
  }
  return NULL;
}

/* An input's data (API 21 reads inputs through the mutable getter; nothing here writes them). */
static OrtStatus *data_of(const OrtValue *value, const void **out) {
  return api->GetTensorMutableData((OrtValue *)value, (void **)out);
}

/* ---- packing: MatMulNBits' B [N, blocks, block/2], scales [N*blocks], zero points [N, ceil(blocks/2)] ---- */

typedef struct {
  RowsOp *op;
  const uint8_t *b, *zp;
  const float *scales;
} PackWork;

/* One column group's tiles (a task of onnxruntime's thread pool: the first run packs on every thread). A chunk of
 * 32 inputs is 8 vectors W_j of `width` dwords, dword c holding column c's codes 4j..4j+3; 4-bit codes are stored two
 * to a byte, W_2k in the low nibbles and W_2k+1 in the high ones. */
static void pack_group(void *data, size_t group) {
  const PackWork *w = data;
  RowsOp *op = w->op;
  const uint8_t *b = w->b, *zp = w->zp;
  const float *scales = w->scales;
  int64_t g = (int64_t)group, width = op->width, vec = width * 4; /* bytes of one W_j */
  int64_t block_bytes = op->block * op->bits / 8;
  int64_t zp_bytes = op->bits == 4 ? (op->blocks + 1) / 2 : op->blocks; /* per column: 4-bit ones two to a byte */
  for (int64_t blk = 0; blk < op->blocks; blk++) {
    int64_t at = g * op->blocks + blk;
    uint8_t *tile = op->packed + at * op->code_bytes;
    float *s = op->scales + at * width;
    uint8_t *z = op->zeros + at * width;
    memset(tile, 0, op->code_bytes);
    memset(s, 0, (size_t)width * sizeof(float));
    memset(z, 0, (size_t)width);
    for (int64_t c = 0; c < width; c++) {
      int64_t n = g * width + c;
      if (n >= op->n) continue;
      const uint8_t *src = b + (n * op->blocks + blk) * block_bytes;
      if (op->bits == 8) { /* chunk[j*vec + c*4 + t] = code 4j+t of the 32 */
        for (int64_t sub = 0; sub < op->subs; sub++, src += SUB)
          for (int j = 0; j < 8; j++) memcpy(tile + sub * 8 * vec + j * vec + c * 4, src + 4 * j, 4);
      } else { /* byte j of src: codes 2j (low), 2j+1 (high) */
        for (int64_t sub = 0; sub < op->subs; sub++, src += SUB / 2) {
          uint8_t *chunk = tile + sub * 4 * vec + c * 4;
          /* chunk[k*vec + t]: code 8k+t (low nibble) and code 8k+4+t (high): 8k+t is byte 4k+t/2 of src */
          for (int k = 0; k < 4; k++)
            for (int t = 0; t < 4; t++) {
              uint8_t lo = src[4 * k + t / 2], hi = src[4 * k + 2 + t / 2];
              lo = (t & 1) ? (lo >> 4) : (lo & 15);
              hi = (t & 1) ? (hi >> 4) : (hi & 15);
              chunk[k * vec + t] = (uint8_t)(lo | (hi << 4));
            }
        }
      }
      s[c] = scales[n * op->blocks + blk];
      if (op->bits == 8) {
        z[c] = zp ? zp[n * zp_bytes + blk] : 128;
      } else {
        uint8_t zb = zp ? zp[n * zp_bytes + blk / 2] : 0x88;
        z[c] = (uint8_t)((blk & 1) ? (zb >> 4) : (zb & 15));
      }
    }
  }
}

/* ---- activations: each block of each row rounded to int8 with step amax/127 ---- */

static int alloc_acts(int64_t rows, const RowsOp *op, Acts *a) {
  a->rows = rows;
  a->stride = op->blocks * op->block;
  a->q = aligned_alloc(64, (size_t)((rows * a->stride + 63) / 64 * 64));
  a->scale = malloc(sizeof(float) * (size_t)(rows * op->blocks));
  a->zsum = malloc(sizeof(float) * (size_t)(rows * op->blocks));
  return a->q && a->scale && a->zsum;
}

static void free_acts(Acts *a) {
  free(a->q);
  free(a->scale);
  free(a->zsum);
}

static inline AVX512 __mmask16 take(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

static AVX512 void round_rows_avx512(const float *x, const RowsOp *op, Acts *a) {
  for (int64_t r = 0; r < a->rows; r++) {
    const float *xr = x + r * op->k;
    for (int64_t blk = 0; blk < op->blocks; blk++) {
      int64_t lo = blk * op->block;
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = lo; i < lo + op->block; i += 16)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(take(op->k - i), xr + i)));
      float amax = _mm512_reduce_max_ps(m);
      float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512 vinv = _mm512_set1_ps(inv);
      __m512i sum = _mm512_setzero_si512();
      int8_t *q = a->q + r * a->stride + lo;
      for (int64_t i = lo; i < lo + op->block; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(take(op->k - i), xr + i), vinv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i *)(q + (i - lo)), _mm512_cvtepi32_epi8(v));
      }
      a->scale[r * op->blocks + blk] = step;
      a->zsum[r * op->blocks + blk] = step * (float)_mm512_reduce_add_epi32(sum);
    }
  }
}

/* AVX2: the same rounding (cvtps_epi32 rounds to nearest even, as above), 8 lanes at a time. */
static AVX2 void round_rows_avx2(const float *x, const RowsOp *op, Acts *a) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < a->rows; r++) {
    const float *xr = x + r * op->k;
    for (int64_t blk = 0; blk < op->blocks; blk++) {
      int64_t lo = blk * op->block;
      float part[8] __attribute__((aligned(32)));
      __m256 m = _mm256_setzero_ps();
      for (int64_t i = lo; i < lo + op->block; i += 8) {
        __m256 v;
        if (i + 8 <= op->k) {
          v = _mm256_loadu_ps(xr + i);
        } else {
          for (int t = 0; t < 8; t++) part[t] = i + t < op->k ? xr[i + t] : 0.f;
          v = _mm256_load_ps(part);
        }
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
      }
      float lanes[8] __attribute__((aligned(32)));
      _mm256_store_ps(lanes, m);
      float amax = 0.f;
      for (int t = 0; t < 8; t++) amax = lanes[t] > amax ? lanes[t] : amax;
      float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m256 vinv = _mm256_set1_ps(inv);
      int32_t sum = 0, codes[8] __attribute__((aligned(32)));
      int8_t *q = a->q + r * a->stride + lo;
      for (int64_t i = lo; i < lo + op->block; i += 8) {
        __m256 v;
        if (i + 8 <= op->k) {
          v = _mm256_loadu_ps(xr + i);
        } else {
          for (int t = 0; t < 8; t++) part[t] = i + t < op->k ? xr[i + t] : 0.f;
          v = _mm256_load_ps(part);
        }
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv));
        c = _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        _mm256_store_si256((__m256i *)codes, c);
        for (int t = 0; t < 8; t++) {
          q[i - lo + t] = (int8_t)codes[t];
          sum += codes[t];
        }
      }
      a->scale[r * op->blocks + blk] = step;
      a->zsum[r * op->blocks + blk] = step * (float)sum;
    }
  }
}

/* ---- the product: one column group for up to ROW_TILE rows ---- */

static inline __attribute__((always_inline)) AVX512 void group_rows(const RowsOp *op, const Acts *a, int64_t g,
                                                                    int64_t r0, const int rows, const int bits,
                                                                    const float *bias, float *y) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[ROW_TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
  const uint8_t *tile = op->packed + g * op->blocks * op->code_bytes;
  const float *sp = op->scales + g * op->blocks * GROUP;
  const uint8_t *zp = op->zeros + g * op->blocks * GROUP;
  for (int64_t blk = 0; blk < op->blocks; blk++, tile += op->code_bytes, sp += GROUP, zp += GROUP) {
    /* integer dot products in `chains` independent accumulators per row (exact: their sum is the same for any
       count), so few rows are not bound by vpdpbusd's latency */
    const int chains = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
    __m512i dot[ROW_TILE][4];
    for (int r = 0; r < rows; r++)
      for (int c = 0; c < chains; c++) dot[r][c] = _mm512_setzero_si512();
    for (int64_t sub = 0; sub < op->subs; sub++) {
      __m512i w[8];
      if (bits == 8) {
        const __m512i *chunk = (const __m512i *)(tile + sub * 512);
        for (int j = 0; j < 8; j++) w[j] = _mm512_load_si512(chunk + j);
      } else {
        const __m512i *chunk = (const __m512i *)(tile + sub * 256);
        for (int k = 0; k < 4; k++) {
          __m512i p = _mm512_load_si512(chunk + k);
          w[2 * k] = _mm512_and_si512(p, low);
          w[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
        }
      }
      for (int r = 0; r < rows; r++) {
        const int32_t *q = (const int32_t *)(a->q + (r0 + r) * a->stride + blk * op->block + sub * SUB);
        for (int j = 0; j < 8; j++)
          dot[r][j % chains] = _mm512_dpbusd_epi32(dot[r][j % chains], w[j], _mm512_set1_epi32(q[j]));
      }
    }
    __m512 s = _mm512_load_ps(sp);
    __m512 sz = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)zp))));
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * op->blocks + blk;
      __m512i d = dot[r][0];
      for (int c = 1; c < chains; c++) d = _mm512_add_epi32(d, dot[r][c]);
      /* the same float operations whatever the tile's row count: a row's result never depends on its batch */
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(a->scale[at]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_fmsub_ps(s, t, _mm512_mul_ps(sz, _mm512_set1_ps(a->zsum[at]))));
    }
  }
  int64_t c0 = g * GROUP, left = op->n - c0;
  __mmask16 mask = left >= GROUP ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; r++)
    _mm512_mask_storeu_ps(y + (r0 + r) * op->n + c0, mask, _mm512_add_ps(acc[r], b));
}

/* AVX-VNNI's vpdpbusd on ymm (VEX-encoded: written as asm so this AVX2 function may hold it; it runs only where the
 * CPU has AVX-VNNI). */
static inline __attribute__((always_inline)) AVX2 __m256i dpbusd_vex(__m256i acc, __m256i u8, __m256i s8) {
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u8), "x"(s8));
  return acc;
}

/* 8 columns a group. AVX-VNNI: vpdpbusd, 4- and 8-bit. AVX2, 4-bit only: u8 x s8 pairs added in 16 bits by
 * vpmaddubsw (at most 2*15*127 = 3810: no saturation for 4-bit codes), a chunk's 8 of them in 16 bits too, and then
 * in 32 bits by vpmaddwd. */
static inline __attribute__((always_inline)) AVX2 void group_rows_avx2(const RowsOp *op, const Acts *a, int64_t g,
                                                                       int64_t r0, const int rows, const int vnni,
                                                                       const int bits, const float *bias, float *y) {
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[ROW_TILE];
  for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
  const uint8_t *tile = op->packed + g * op->blocks * op->code_bytes;
  const float *sp = op->scales + g * op->blocks * 8;
  const uint8_t *zp = op->zeros + g * op->blocks * 8;
  for (int64_t blk = 0; blk < op->blocks; blk++, tile += op->code_bytes, sp += 8, zp += 8) {
    const int chains = vnni ? (rows <= 2 ? 4 : rows <= 4 ? 2 : 1) : 2; /* as on AVX-512: exact integer sums */
    __m256i dot[ROW_TILE][4];
    for (int r = 0; r < rows; r++)
      for (int c = 0; c < chains; c++) dot[r][c] = _mm256_setzero_si256();
    for (int64_t sub = 0; sub < op->subs; sub++) {
      __m256i w[8];
      if (bits == 8) {
        const __m256i *chunk = (const __m256i *)(tile + sub * 256);
        for (int j = 0; j < 8; j++) w[j] = _mm256_load_si256(chunk + j);
      } else {
        const __m256i *chunk = (const __m256i *)(tile + sub * 128);
        for (int k = 0; k < 4; k++) {
          __m256i p = _mm256_load_si256(chunk + k);
          w[2 * k] = _mm256_and_si256(p, low);
          w[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        }
      }
      for (int r = 0; r < rows; r++) {
        const int32_t *q = (const int32_t *)(a->q + (r0 + r) * a->stride + blk * op->block + sub * SUB);
        if (vnni) {
          for (int j = 0; j < 8; j++)
            dot[r][j % chains] = dpbusd_vex(dot[r][j % chains], w[j], _mm256_set1_epi32(q[j]));
          continue;
        }
        /* the 8 pair sums of a column add up in 16 bits (at most 8 * 3810 = 30480), then widen once */
        __m256i even = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(q[0]));
        __m256i odd = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(q[1]));
        for (int j = 2; j < 8; j += 2) {
          even = _mm256_add_epi16(even, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(q[j])));
          odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(w[j + 1], _mm256_set1_epi32(q[j + 1])));
        }
        dot[r][sub & 1] = _mm256_add_epi32(dot[r][sub & 1], _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones));
      }
    }
    __m256 s = _mm256_load_ps(sp);
    __m256 sz = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)zp))));
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * op->blocks + blk;
      __m256i d = dot[r][0];
      for (int c = 1; c < chains; c++) d = _mm256_add_epi32(d, dot[r][c]);
      __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(a->scale[at]));
      acc[r] = _mm256_add_ps(acc[r], _mm256_fmsub_ps(s, t, _mm256_mul_ps(sz, _mm256_set1_ps(a->zsum[at]))));
    }
  }
  int64_t c0 = g * 8, left = op->n - c0;
  float b[8] = {0}, out[8];
  for (int c = 0; c < 8 && c < left; c++) b[c] = bias ? bias[c0 + c] : 0.f;
  __m256 vb = _mm256_loadu_ps(b);
  for (int r = 0; r < rows; r++) {
    if (left >= 8) {
      _mm256_storeu_ps(y + (r0 + r) * op->n + c0, _mm256_add_ps(acc[r], vb));
    } else {
      _mm256_storeu_ps(out, _mm256_add_ps(acc[r], vb));
      memcpy(y + (r0 + r) * op->n + c0, out, sizeof(float) * (size_t)left);
    }
  }
}

#define ROWS_CASE(n)                                 \
  case n:                                            \
    if (op->bits == 8)                               \
      group_rows(op, a, g, r0, n, 8, bias, y);       \
    else                                             \
      group_rows(op, a, g, r0, n, 4, bias, y);       \
    break;

static AVX512 void group_all_rows_avx512(const RowsOp *op, const Acts *a, int64_t g, const float *bias, float *y) {
  for (int64_t r0 = 0; r0 < a->rows; r0 += ROW_TILE) {
    switch (a->rows - r0 >= ROW_TILE ? ROW_TILE : a->rows - r0) {
      ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
      default: ROWS_CASE(8)
    }
  }
}

#define ROWS_CASE2(n)                                  \
  case n:                                              \
    if (!op->vnni)                                     \
      group_rows_avx2(op, a, g, r0, n, 0, 4, bias, y); \
    else if (op->bits == 8)                            \
      group_rows_avx2(op, a, g, r0, n, 1, 8, bias, y); \
    else                                               \
      group_rows_avx2(op, a, g, r0, n, 1, 4, bias, y); \
    break;

static AVX2 void group_all_rows_avx2(const RowsOp *op, const Acts *a, int64_t g, const float *bias, float *y) {
  for (int64_t r0 = 0; r0 < a->rows; r0 += ROW_TILE) {
    switch (a->rows - r0 >= ROW_TILE ? ROW_TILE : a->rows - r0) {
      ROWS_CASE2(1) ROWS_CASE2(2) ROWS_CASE2(3) ROWS_CASE2(4) ROWS_CASE2(5) ROWS_CASE2(6) ROWS_CASE2(7)
      default: ROWS_CASE2(8)
    }
  }
}

static void run_task(void *data, size_t task) {
  const Work *w = data;
  int64_t g0 = (int64_t)task * w->groups_per_task, g1 = g0 + w->groups_per_task;
  if (g1 > w->op->groups) g1 = w->op->groups;
  for (int64_t g = g0; g < g1; g++) {
    if (w->op->width == GROUP)
      group_all_rows_avx512(w->op, w->acts, g, w->bias, w->y);
    else
      group_all_rows_avx2(w->op, w->acts, g, w->bias, w->y);
  }
}

/* ---- onnxruntime glue ---- */

#define CHECK(expr)                       \
  do {                                    \
    OrtStatus *status_ = (expr);          \
    if (status_) return status_;          \
  } while (0)

static OrtStatus *ORT_API_CALL create_kernel(const OrtCustomOp *self, const OrtApi *ort, const OrtKernelInfo *info,
                                             void **out) {
  (void)self;
  (void)ort;
  int64_t k = 0, n = 0, bits = 0, block = 0, accuracy = 0;
  CHECK(api->KernelInfoGetAttribute_int64(info, "K", &k));
  CHECK(api->KernelInfoGetAttribute_int64(info, "N", &n));
  OrtStatus *unset = api->KernelInfoGetAttribute_int64(info, "bits", &bits);
  if (unset) { /* optional in the schema: 4 */
    api->ReleaseStatus(unset);
    bits = 4;
  }
  CHECK(api->KernelInfoGetAttribute_int64(info, "block_size", &block));
  OrtStatus *none = api->KernelInfoGetAttribute_int64(info, "accuracy_level", &accuracy);
  if (none) {
    api->ReleaseStatus(none);
    accuracy = 0;
  }
  int wide = isa == ISA_AVX512, eight = wide || isa == ISA_AVXVNNI;
  if ((bits != 4 && !(bits == 8 && eight)) || block < SUB || block % SUB || accuracy != 4 || k <= 0 || n <= 0)
    return fail(eight ? "lineside rows: only 4- or 8-bit weights, block a multiple of 32, accuracy level 4"
                      : "lineside rows: only 4-bit weights on AVX2, block a multiple of 32, accuracy level 4");
  RowsOp *op = calloc(1, sizeof(RowsOp));
  if (!op) return fail("lineside rows: out of memory");
  op->k = k;
  op->n = n;
  op->bits = bits;
  op->block = block;
  op->width = wide ? GROUP : 8;
  op->vnni = isa == ISA_AVXVNNI;
  op->blocks = (k + block - 1) / block;
  op->groups = (n + op->width - 1) / op->width;
  op->subs = block / SUB;
  op->code_bytes = (size_t)(op->subs * op->width * (bits == 4 ? 16 : 32));
  pthread_mutex_init(&op->lock, NULL);
  *out = op;
  return NULL;
}

static OrtStatus *ensure_packed(RowsOp *op, OrtKernelContext *ctx, const OrtValue *b, const OrtValue *scales,
                                const OrtValue *zp) {
  const void *bdata, *sdata, *zdata = NULL;
  CHECK(data_of(b, &bdata));
  CHECK(data_of(scales, &sdata));
  if (zp) CHECK(data_of(zp, &zdata));
  pthread_mutex_lock(&op->lock);
  if (op->packed_from != NULL && op->packed_from != bdata) {
    /* constant weights never move (rows_kernel.py moves no node whose weights a run may override); repacking here
       would free what a concurrent run still reads */
    pthread_mutex_unlock(&op->lock);
    return fail("lineside rows: the weights changed between runs");
  }
  if (op->packed_from != bdata) {
    free(op->packed);
    size_t tiles = (size_t)(op->groups * op->blocks);
    size_t width = (size_t)op->width;
    op->packed = aligned_alloc(64, (tiles * (op->code_bytes + width * sizeof(float) + width) + 63) / 64 * 64);
    if (!op->packed) {
      pthread_mutex_unlock(&op->lock);
      return fail("lineside rows: out of memory packing weights");
    }
    op->scales = (float *)(op->packed + tiles * op->code_bytes);
    op->zeros = (uint8_t *)(op->scales + tiles * width);
    PackWork work = {op, bdata, zdata, sdata};
    OrtStatus *st = api->KernelContext_ParallelFor(ctx, pack_group, (size_t)op->groups, 0, &work);
    if (st) {
      pthread_mutex_unlock(&op->lock);
      return st;
    }
    op->packed_from = bdata;
  }
  pthread_mutex_unlock(&op->lock);
  return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
  RowsOp *op = kernel;
  const OrtValue *x, *b, *scales, *zp = NULL, *gidx = NULL, *bias = NULL;
  size_t inputs = 0;
  CHECK(api->KernelContext_GetInputCount(ctx, &inputs));
  CHECK(api->KernelContext_GetInput(ctx, 0, &x));
  CHECK(api->KernelContext_GetInput(ctx, 1, &b));
  CHECK(api->KernelContext_GetInput(ctx, 2, &scales));
  if (inputs > 3) CHECK(api->KernelContext_GetInput(ctx, 3, &zp));
  if (inputs > 4) CHECK(api->KernelContext_GetInput(ctx, 4, &gidx));
  if (inputs > 5) CHECK(api->KernelContext_GetInput(ctx, 5, &bias));
  if (gidx) return fail("lineside rows: g_idx is not supported");
  if (zp) {
    ONNXTensorElementDataType type;
    OrtTensorTypeAndShapeInfo *zinfo;
    CHECK(api->GetTensorTypeAndShape(zp, &zinfo));
    OrtStatus *st = api->GetTensorElementType(zinfo, &type);
    api->ReleaseTensorTypeAndShapeInfo(zinfo);
    if (st) return st;
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) return fail("lineside rows: zero points must be uint8");
  }
  int64_t zp_count = op->n * ((op->blocks * op->bits + 7) / 8);
  CHECK(expect_count(b, op->n * op->blocks * (op->block * op->bits / 8), "B"));
  CHECK(expect_count(scales, op->n * op->blocks, "scales"));
  if (zp) CHECK(expect_count(zp, zp_count, "zero_points"));
  if (bias) CHECK(expect_count(bias, op->n, "bias"));
  CHECK(ensure_packed(op, ctx, b, scales, zp));

  OrtTensorTypeAndShapeInfo *info;
  CHECK(api->GetTensorTypeAndShape(x, &info));
  size_t rank = 0;
  int64_t dims[8];
  OrtStatus *st = api->GetDimensionsCount(info, &rank);
  if (!st && (rank < 1 || rank > 8)) st = fail("lineside rows: input rank must be 1..8");
  if (!st) st = api->GetDimensions(info, dims, rank);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (st) return st;
  if (dims[rank - 1] != op->k) return fail("lineside rows: input's last dimension is not K");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
  dims[rank - 1] = op->n;
  OrtValue *out;
  CHECK(api->KernelContext_GetOutput(ctx, 0, dims, rank, &out));
  float *y;
  const float *xd, *bd = NULL;
  CHECK(api->GetTensorMutableData(out, (void **)&y));
  if (rows == 0) return NULL;
  CHECK(data_of(x, (const void **)&xd));
  if (bias) CHECK(data_of(bias, (const void **)&bd));

  Acts acts;
  if (!alloc_acts(rows, op, &acts)) {
    free_acts(&acts);
    return fail("lineside rows: out of memory");
  }
  if (op->width == GROUP)
    round_rows_avx512(xd, op, &acts);
  else
    round_rows_avx2(xd, op, &acts);
  Work work = {op, &acts, bd, y, 0};
  /* tasks of ~64 KiB of packed weights: few enough to keep onnxruntime's dispatch cheap, enough to balance */
  int64_t per = (int64_t)(65536 / ((size_t)op->blocks * op->code_bytes));
  work.groups_per_task = per < 1 ? 1 : per;
  size_t tasks = (size_t)((op->groups + work.groups_per_task - 1) / work.groups_per_task);
  st = tasks > 1 ? api->KernelContext_ParallelFor(ctx, run_task, tasks, 0, &work) : NULL;
  if (tasks <= 1) run_task(&work, 0);
  free_acts(&acts);
  return st;
}

static void ORT_API_CALL destroy_kernel(void *kernel) {
  RowsOp *op = kernel;
  free(op->packed);
  pthread_mutex_destroy(&op->lock);
  free(op);
}

static unsigned long unnamed; /* dimensions named by infer_shape */

static OrtStatus *ORT_API_CALL infer_shape(const OrtCustomOp *self, OrtShapeInferContext *ctx) {
  (void)self;
  int64_t n = 0, dims[8];
  const char *names[8];
  const OrtOpAttr *attr;
  size_t got = 0, rank = 0;
  CHECK(api->ShapeInferContext_GetAttribute(ctx, "N", &attr));
  CHECK(api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &n, sizeof(n), &got));
  OrtTensorTypeAndShapeInfo *in, *out = NULL;
  CHECK(api->ShapeInferContext_GetInputTypeShape(ctx, 0, &in));
  OrtStatus *st = api->GetDimensionsCount(in, &rank);
  if (!st && rank == 0) return NULL; /* rank unknown here: the output's shape stays unknown too */
  if (!st && rank > 8) st = fail("lineside rows: input rank must be 1..8");
  if (!st) st = api->GetDimensions(in, dims, rank);
  if (!st) st = api->GetSymbolicDimensions(in, names, rank);
  if (!st) st = api->CreateTensorTypeAndShapeInfo(&out);
  /* an unknown dimension must stay unknown: one without a name would go out as the value -1, which a Shape ->
     Reshape downstream reads as a second "-1" and refuses. So it gets a name of its own (unique: two such
     dimensions elsewhere in the graph are not known to be equal). */
  char own[8][32];
  if (!st) {
    for (size_t i = 0; i + 1 < rank; i++)
      if (dims[i] < 0 && (!names[i] || !names[i][0])) {
        snprintf(own[i], sizeof(own[i]), "lineside_rows_%lu",
                 (unsigned long)__atomic_add_fetch(&unnamed, 1, __ATOMIC_RELAXED));
        names[i] = own[i];
      }
    dims[rank - 1] = n;
    names[rank - 1] = "";
    st = api->SetTensorElementType(out, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  }
  if (!st) st = api->SetDimensions(out, dims, rank);
  if (!st) st = api->SetSymbolicDimensions(out, names, rank);
  if (!st) st = api->ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  if (out) api->ReleaseTensorTypeAndShapeInfo(out);
  return st; /* `in` belongs to the context (onnxruntime frees it; releasing it here is a double free) */
}

static const char *ORT_API_CALL op_name(const OrtCustomOp *self) { (void)self; return "MatMulNBits"; }
static const char *ORT_API_CALL op_provider(const OrtCustomOp *self) { (void)self; return "CPUExecutionProvider"; }
static size_t ORT_API_CALL input_count(const OrtCustomOp *self) { (void)self; return 6; }
static size_t ORT_API_CALL output_count(const OrtCustomOp *self) { (void)self; return 1; }

static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *self, size_t i) {
  (void)self;
  switch (i) {
    case 1: case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}

static ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp *self, size_t i) {
  (void)self;
  (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *self, size_t i) {
  (void)self;
  return i < 3 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_kind(const OrtCustomOp *self, size_t i) {
  (void)self;
  (void)i;
  return INPUT_OUTPUT_REQUIRED;
}

static OrtMemType ORT_API_CALL input_memory(const OrtCustomOp *self, size_t i) {
  (void)self;
  (void)i;
  return OrtMemTypeDefault;
}

static int ORT_API_CALL start_version(const OrtCustomOp *self) { (void)self; return 1; }
static int ORT_API_CALL end_version(const OrtCustomOp *self) { (void)self; return 2147483647; }

static OrtCustomOp rows_op;
static OrtCustomOpDomain *domain;

/* What this process runs: 3 AVX-512 VNNI, 4 AVX-VNNI (AVX2 + FMA + 256-bit vpdpbusd: Intel Core since Alder Lake),
   both 4- and 8-bit; 2 AVX2 + FMA, 4-bit only; 0 none. LINESIDE_ROWS_ISA=avx2 or avxvnni takes that path on a CPU
   that has more (to test it, or compare). rows_kernel.py asks the library before rewriting a graph. */
int lineside_rows_isa(void) {
  __builtin_cpu_init();
  const char *forced = getenv("LINESIDE_ROWS_ISA");
  forced = forced ? forced : "";
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  int avxvnni = avx2 && __builtin_cpu_supports("avxvnni");
  int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
  if (avx512 && strcmp(forced, "avx2") != 0 && strcmp(forced, "avxvnni") != 0) return ISA_AVX512;
  if (avxvnni && strcmp(forced, "avx2") != 0) return ISA_AVXVNNI;
  return avx2 ? ISA_AVX2 : ISA_NONE;
}

OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  api = base->GetApi(ORT_API_VERSION);
  if (!api) { /* older than the header's API: the first API's CreateStatus still reports it */
    const OrtApi *oldest = base->GetApi(1);
    return oldest ? oldest->CreateStatus(ORT_FAIL, "lineside rows: onnxruntime older than 1.21") : NULL;
  }
  isa = lineside_rows_isa();
  if (isa == ISA_NONE) return api->CreateStatus(ORT_FAIL, "lineside rows: this CPU has neither AVX-512 VNNI nor AVX2");
  if (domain) return api->AddCustomOpDomain(options, domain); /* one op and domain, shared by every session */
  rows_op.version = ORT_API_VERSION;
  rows_op.GetName = op_name;
  rows_op.GetExecutionProviderType = op_provider;
  rows_op.GetInputType = input_type;
  rows_op.GetInputTypeCount = input_count;
  rows_op.GetOutputType = output_type;
  rows_op.GetOutputTypeCount = output_count;
  rows_op.KernelDestroy = destroy_kernel;
  rows_op.GetInputCharacteristic = input_kind;
  rows_op.GetOutputCharacteristic = output_kind;
  rows_op.GetInputMemoryType = input_memory;
  rows_op.CreateKernelV2 = create_kernel;
  rows_op.KernelComputeV2 = compute;
  rows_op.InferOutputShapeFn = infer_shape;
  rows_op.GetStartVersion = start_version;
  rows_op.GetEndVersion = end_version;
  OrtCustomOpDomain *made = NULL;
  CHECK(api->CreateCustomOpDomain("ai.lineside", &made));
  OrtStatus *st = api->CustomOpDomain_Add(made, &rows_op);
  if (st) {
    api->ReleaseCustomOpDomain(made);
    return st;
  }
  domain = made; /* published whole: a failed registration is tried again next time */
  return api->AddCustomOpDomain(options, domain);
}
