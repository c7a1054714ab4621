/* Decode attention over the engine's slot cache, for the float32 and bfloat16 engines.

   A decode step attends a few query heads per kv head (the grouped heads folded together)
   over one sequence's cached keys. PyTorch's CPU kernels pay a fixed setup per
   (row, head) that costs more than the arithmetic at these sizes; this loop computes
   each (row, kv head) in one pass over exactly its own keys, accumulating in float32.
   Each (row, head) is computed by one thread in a fixed order, so a row's result does not
   depend on its batch or the thread count. Built and loaded by native_attention.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#pragma omp declare simd notinbranch
float expf(float);

static inline float bf16_to_float(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return (uint16_t)(bits >> 16);
}

/* row j of a (keys, D) block of bf16 or float32 values, as float32 */
static inline __attribute__((always_inline)) void load_row(float* row, const void* src, int64_t j,
                                                           int64_t D, int bf16) {
  if (bf16) {
    const uint16_t* r = (const uint16_t*)src + j * D;
    #pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = bf16_to_float(r[d]);
  } else {
    memcpy(row, (const float*)src + j * D, D * sizeof(float));
  }
}

/* one (row, kv head): G queries of D, pre-scaled, against its first L keys and values */
static inline __attribute__((always_inline)) void attend_one(const float* q, const void* k, const void* v, int bf16, int64_t L,
                       int64_t G, int64_t D, float* scores, float* row, float* acc) {
  for (int64_t j = 0; j < L; ++j) {
    load_row(row, k, j, D, bf16);
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      #pragma omp simd reduction(+:s)
      for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * row[d];
      scores[g * L + j] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = sg[0];
    for (int64_t j = 1; j < L; ++j) m = sg[j] > m ? sg[j] : m;
    float total = 0.f;
    #pragma omp simd reduction(+:total)
    for (int64_t j = 0; j < L; ++j) { sg[j] = expf(sg[j] - m); total += sg[j]; }
    const float inv = 1.f / total;
    #pragma omp simd
    for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
  }
  memset(acc, 0, G * D * sizeof(float));
  for (int64_t j = 0; j < L; ++j) {
    load_row(row, v, j, D, bf16);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + j];
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
    }
  }
}

/* q, out: (B, KV, G, D) contiguous; k, v: (slots, KV, capacity, D), row b in slot b.
   Returns nonzero if a work buffer could not be allocated. */
int decode_attention(const void* q, const void* k, const void* v, const int64_t* lengths, void* out,
                     int64_t B, int64_t KV, int64_t G, int64_t D, int64_t slot_stride,
                     int64_t head_stride, int64_t max_len, float scale, int bf16, int threads) {
  const int64_t esize = bf16 ? 2 : 4;
  int failed = 0;
  #pragma omp parallel num_threads(threads)
  {
    float* buf = malloc(sizeof(float) * (G * max_len + D + 2 * G * D));
    if (!buf) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(static)
    for (int64_t idx = 0; idx < B * KV; ++idx) {
      if (!buf) continue;
      const int64_t b = idx / KV, h = idx % KV;
      float *scores = buf, *row = buf + G * max_len, *qf = row + D, *acc = qf + G * D;
      const char* qp = (const char*)q + idx * G * D * esize;
      for (int64_t i = 0; i < G * D; ++i)
        qf[i] = (bf16 ? bf16_to_float(((const uint16_t*)qp)[i]) : ((const float*)qp)[i]) * scale;
      const int64_t offset = (b * slot_stride + h * head_stride) * esize;
      const void *kp = (const char*)k + offset, *vp = (const char*)v + offset;
      /* a constant head size lets the compiler unroll the per-key loops (each is a few
         vectors long, and loop setup cost more than the arithmetic) */
      if (D == 64) attend_one(qf, kp, vp, bf16, lengths[b], G, 64, scores, row, acc);
      else if (D == 128) attend_one(qf, kp, vp, bf16, lengths[b], G, 128, scores, row, acc);
      else attend_one(qf, kp, vp, bf16, lengths[b], G, D, scores, row, acc);
      char* op = (char*)out + idx * G * D * esize;
      for (int64_t i = 0; i < G * D; ++i) {
        if (bf16) ((uint16_t*)op)[i] = float_to_bf16(acc[i]);
        else ((float*)op)[i] = acc[i];
      }
    }
    free(buf);
  }
  return failed;
}
