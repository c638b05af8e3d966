// Rows of the host tier moved by the host's cores: the write-backs scattered into the tier and
// the misses gathered out of it, each over staging rows that lie one after another (see
// host_move.py). hm_move has the shape of a CUDA host function (cudaHostFn_t: void (*)(void*)),
// so a CUDA graph can run it between the kernels that fill and drain the staging rows; it calls
// no CUDA function. The counts are read when it runs: a kernel queued before it may write them.
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
  float* host;            // [capacity, width]: the host tier
  int64_t width;          // floats a row
  const int64_t* back;    // [counts[0]] rows written back: host[back[i]] = out[i]
  const float* out;       // [counts[0], width]
  const int64_t* read;    // [counts[1]] rows read: in[i] = host[read[i]]
  float* in;              // [counts[1], width]
  const int64_t* counts;  // [2]: rows written back, rows read
  int64_t threads;        // threads to split the rows over (>= 1)
} hm_params;

typedef struct {
  const hm_params* p;
  int64_t part;
} hm_part;

#define HM_AHEAD 8  // rows asked for ahead of the one copied

static inline void hm_prefetch(const float* row, size_t bytes, int write) {
  for (size_t at = 0; at < bytes; at += 64) {
    if (write)
      __builtin_prefetch((const char*)row + at, 1, 0);
    else
      __builtin_prefetch((const char*)row + at, 0, 0);
  }
}

static void* hm_run_part(void* arg) {
  const hm_part* t = (const hm_part*)arg;
  const hm_params* p = t->p;
  const size_t bytes = (size_t)p->width * sizeof(float);
  const int64_t nb = p->counts[0], nr = p->counts[1];
  // the write-backs first: a row read is never among the rows written (the cache's are not).
  // Random rows wait on memory: each loop asks for the row HM_AHEAD iterations on early, so
  // several rows are on their way at once (every cache line of it).
  const int64_t b0 = nb * t->part / p->threads, b1 = nb * (t->part + 1) / p->threads;
  for (int64_t i = b0; i < b1; ++i) {
    if (i + HM_AHEAD < b1) hm_prefetch(p->host + p->back[i + HM_AHEAD] * p->width, bytes, 1);
    memcpy(p->host + p->back[i] * p->width, p->out + i * p->width, bytes);
  }
  const int64_t r0 = nr * t->part / p->threads, r1 = nr * (t->part + 1) / p->threads;
  for (int64_t i = r0; i < r1; ++i) {
    if (i + HM_AHEAD < r1) hm_prefetch(p->host + p->read[i + HM_AHEAD] * p->width, bytes, 0);
    memcpy(p->in + i * p->width, p->host + p->read[i] * p->width, bytes);
  }
  return NULL;
}

#define HM_MAX_THREADS 256

// Both moves of *arg (an hm_params), split over its threads (this one and threads - 1 more).
#define HM_ROWS_A_THREAD 4096  // fewer rows than this a thread: fewer threads (each costs a start)

void hm_move(void* arg) {
  const hm_params* p = (const hm_params*)arg;
  int64_t n = p->threads < 1 ? 1 : (p->threads > HM_MAX_THREADS ? HM_MAX_THREADS : p->threads);
  const int64_t enough = (p->counts[0] + p->counts[1] + HM_ROWS_A_THREAD - 1) / HM_ROWS_A_THREAD;
  if (n > enough) n = enough < 1 ? 1 : enough;
  hm_params q = *p;
  q.threads = n;
  hm_part parts[HM_MAX_THREADS];
  pthread_t ids[HM_MAX_THREADS];
  int started[HM_MAX_THREADS];
  for (int64_t k = 0; k < n; ++k) {
    parts[k].p = &q;
    parts[k].part = k;
    started[k] = k > 0 && pthread_create(&ids[k], NULL, hm_run_part, &parts[k]) == 0;
  }
  hm_run_part(&parts[0]);
  for (int64_t k = 1; k < n; ++k) {
    if (started[k])
      pthread_join(ids[k], NULL);
    else
      hm_run_part(&parts[k]);  // no thread for it: this one does its part
  }
}
