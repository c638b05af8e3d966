// Rows of the host tier moved by the host's cores: the write-backs scattered into the tier and
// the misses gathered out of it, each over staging rows that lie one after another (see
// host_move.py). hm_move has the shape of a CUDA host function (cudaHostFn_t: void (*)(void*)),
// so a CUDA graph can run it between the kernels that fill and drain the staging rows; it calls
// no CUDA function. The counts are read when it runs: a kernel queued before it may write them.
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
  float* host;            // [capacity, width]: the host tier
  int64_t width;          // floats a row
  const int64_t* back;    // [counts[0]] rows written back: host[back[i]] = out[i]
  const float* out;       // [counts[0], width]
  const int64_t* read;    // [counts[1]] rows read: in[i] = host[read[i]]
  float* in;              // [counts[1], width]
  const int64_t* counts;  // [2]: rows written back, rows read
  int64_t threads;        // threads to split the rows over (>= 1)
  int64_t* spent;         // [2]: nanoseconds in moves so far, moves so far (added to by each)
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
#define HM_ROWS_A_THREAD 4096  // fewer rows than this a thread: fewer threads (each costs a wake)

// The helpers are a pool started once and kept: a thread's start and join each step cost about
// as much as the copy of a few thousand rows, and in a CUDA graph they sat on the step's path.
// One move at a time (hm_call): a host function may be called from the driver's threads of
// several streams. Worker k (1..workers) takes part k of each job whose generation it has not
// seen; the caller takes part 0 and every part no worker exists for, then waits until the
// workers' parts are done. A fork's child starts with no workers (pthread_atfork).
typedef struct {
  int64_t index;      // the part this worker takes (>= 1)
  uint64_t seen;      // the last generation it took part in (or skipped)
} hm_start;

static pthread_mutex_t hm_call = PTHREAD_MUTEX_INITIALIZER;  // one move at a time
static pthread_mutex_t hm_lock = PTHREAD_MUTEX_INITIALIZER;  // guards what follows
static pthread_cond_t hm_work = PTHREAD_COND_INITIALIZER;    // a new generation
static pthread_cond_t hm_done = PTHREAD_COND_INITIALIZER;    // hm_remaining fell to 0
static int64_t hm_workers = 0;
static uint64_t hm_generation = 0;
static int64_t hm_parts_n = 0;          // parts of the current job
static int64_t hm_remaining = 0;        // workers' parts of it not done yet
static hm_part* hm_job = NULL;          // the current job's parts (the caller's, on its stack)
static hm_start hm_starts[HM_MAX_THREADS];
static pthread_once_t hm_once = PTHREAD_ONCE_INIT;

static void hm_after_fork_in_child(void) {
  // the child has only the forking thread: no worker, and no lock held by one
  pthread_mutex_init(&hm_call, NULL);
  pthread_mutex_init(&hm_lock, NULL);
  pthread_cond_init(&hm_work, NULL);
  pthread_cond_init(&hm_done, NULL);
  hm_workers = 0;
  hm_remaining = 0;
  hm_job = NULL;
}

static void hm_register_fork(void) { pthread_atfork(NULL, NULL, hm_after_fork_in_child); }

static void* hm_worker(void* arg) {
  hm_start* me = (hm_start*)arg;
  pthread_mutex_lock(&hm_lock);
  for (;;) {
    while (hm_generation == me->seen) pthread_cond_wait(&hm_work, &hm_lock);
    me->seen = hm_generation;
    if (me->index < hm_parts_n) {
      hm_part* part = &hm_job[me->index];
      pthread_mutex_unlock(&hm_lock);
      hm_run_part(part);
      pthread_mutex_lock(&hm_lock);
      if (--hm_remaining == 0) pthread_cond_signal(&hm_done);
    }
  }
  return NULL;
}

static int64_t hm_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void hm_move_rows(const hm_params* p);

// The move of *arg (an hm_params), its wall time and count added to p->spent: how long the
// host's cores held the stream (a host function's time does not show in a device profile).
void hm_move(void* arg) {
  const hm_params* p = (const hm_params*)arg;
  const int64_t t0 = hm_now_ns();
  hm_move_rows(p);
  p->spent[0] += hm_now_ns() - t0;  // one move at a time per hm_params (its stream's order)
  p->spent[1] += 1;
}

static void hm_move_rows(const hm_params* p) {
  int64_t n = p->threads < 1 ? 1 : (p->threads > HM_MAX_THREADS ? HM_MAX_THREADS : p->threads);
  const int64_t enough = (p->counts[0] + p->counts[1] + HM_ROWS_A_THREAD - 1) / HM_ROWS_A_THREAD;
  if (n > enough) n = enough < 1 ? 1 : enough;
  hm_params q = *p;
  q.threads = n;
  hm_part parts[HM_MAX_THREADS];
  for (int64_t k = 0; k < n; ++k) {
    parts[k].p = &q;
    parts[k].part = k;
  }
  if (n == 1) {
    hm_run_part(&parts[0]);
    return;
  }
  pthread_once(&hm_once, hm_register_fork);
  pthread_mutex_lock(&hm_call);
  pthread_mutex_lock(&hm_lock);
  while (hm_workers < n - 1) {  // start the workers this move lacks, once
    hm_start* start = &hm_starts[hm_workers + 1];
    start->index = hm_workers + 1;
    start->seen = hm_generation;  // the job published below is new to it
    pthread_t id;
    if (pthread_create(&id, NULL, hm_worker, start) != 0) break;
    pthread_detach(id);
    ++hm_workers;
  }
  const int64_t pooled = hm_workers + 1 < n ? hm_workers + 1 : n;  // parts the pool takes
  hm_job = parts;
  hm_parts_n = pooled;
  hm_remaining = pooled - 1;
  ++hm_generation;
  pthread_cond_broadcast(&hm_work);
  pthread_mutex_unlock(&hm_lock);
  hm_run_part(&parts[0]);
  for (int64_t k = pooled; k < n; ++k) hm_run_part(&parts[k]);  // no worker for these
  pthread_mutex_lock(&hm_lock);
  while (hm_remaining > 0) pthread_cond_wait(&hm_done, &hm_lock);
  hm_job = NULL;
  hm_parts_n = 0;
  pthread_mutex_unlock(&hm_lock);
  pthread_mutex_unlock(&hm_call);
}
