/* bench.h — helpers shared by the bench/ programs: clocks and medians, the
 * machine label, starting and stopping a private shardd, a small JSON
 * writer, and the streaming-memory floors the programs compare against.
 *
 * Header-only (each bench .c file is its own program); everything is static
 * inline so a program that does not use a helper compiles without warnings.
 * Benchmarks are never tests: nothing here asserts a timing. */
#ifndef SHARDD_BENCH_H
#define SHARDD_BENCH_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shardd.h"

#define MiB (1024.0 * 1024.0)
#define GB 1e9

static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* q-quantile (0..1) of v[0..n), nearest rank; sorts v. */
static inline double bench_quantile(double *v, size_t n, double q) {
  if (n == 0)
    return 0;
  qsort(v, n, sizeof *v, bench_cmp_double);
  size_t i = (size_t)(q * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

static inline double bench_median(double *v, size_t n) {
  return bench_quantile(v, n, 0.5);
}

static inline void bench_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "bench: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

static inline int bench_full(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--full") == 0)
      return 1;
  const char *f = getenv("FULL");
  return f && f[0] && strcmp(f, "0") != 0;
}

static inline const char *bench_build_dir(void) {
  const char *b = getenv("BUILD");
  return b && b[0] ? b : "build";
}

static inline const char *bench_results_dir(void) {
  const char *d = getenv("BENCH_RESULTS");
  d = d && d[0] ? d : "bench/results";
  mkdir(d, 0755);
  return d;
}

/* "model name" of the first CPU in /proc/cpuinfo, into out. */
static inline void bench_cpu_model(char *out, size_t len) {
  snprintf(out, len, "unknown CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (f == NULL)
    return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *p = strchr(line, ':');
      if (p) {
        p++;
        while (*p == ' ' || *p == '\t')
          p++;
        p[strcspn(p, "\n")] = '\0';
        snprintf(out, len, "%s", p);
      }
      break;
    }
  }
  fclose(f);
}

static inline long bench_ncpu(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? n : 1;
}

/* MemAvailable from /proc/meminfo in bytes (0 when unknown). */
static inline double bench_mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  if (f == NULL)
    return 0;
  char line[256];
  double kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1)
      break;
  fclose(f);
  return kb * 1024.0;
}

/* ---- JSON --------------------------------------------------------------- */

/* Opens DIR/name.json and writes the common header fields; the caller
 * continues the top-level object and closes it with bench_json_close. */
static inline FILE *bench_json_open(const char *name, int full) {
  char path[1024], cpu[256], date[64];
  snprintf(path, sizeof path, "%s/%s.json", bench_results_dir(), name);
  FILE *f = fopen(path, "w");
  if (f == NULL)
    bench_die("cannot write %s: %s", path, strerror(errno));
  bench_cpu_model(cpu, sizeof cpu);
  time_t t = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
  fprintf(f, "{\n  \"bench\": \"%s\",\n  \"cpu\": \"%s\",\n  \"ncpu\": %ld,\n"
             "  \"date\": \"%s\",\n  \"full\": %s",
          name, cpu, bench_ncpu(), date, full ? "true" : "false");
  return f;
}

static inline void bench_json_close(FILE *f, const char *name) {
  fprintf(f, "\n}\n");
  fclose(f);
  fprintf(stdout, "(results: %s/%s.json)\n", bench_results_dir(), name);
}

/* ---- a private daemon --------------------------------------------------- */

typedef struct {
  pid_t pid;
  char socket[108];
} bench_daemon;

/* Daemons started and not yet stopped, killed at exit (bench_die included)
 * so that a failed benchmark leaves no shardd behind. */
static pid_t bench_live_daemons[8];

static inline void bench_kill_live_daemons(void) {
  for (int i = 0; i < 8; i++)
    if (bench_live_daemons[i] > 0) {
      kill(bench_live_daemons[i], SIGTERM);
      waitpid(bench_live_daemons[i], NULL, 0);
      bench_live_daemons[i] = 0;
    }
}

static inline void bench_track_daemon(pid_t pid, int add) {
  static int registered;
  if (!registered) {
    atexit(bench_kill_live_daemons);
    registered = 1;
  }
  for (int i = 0; i < 8; i++)
    if (add ? bench_live_daemons[i] == 0 : bench_live_daemons[i] == pid) {
      bench_live_daemons[i] = add ? pid : 0;
      return;
    }
}

/* Pins the calling thread to one CPU (cpu < 0: leaves it as it is). */
static inline void bench_pin(int cpu) {
  if (cpu < 0)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* ---- ranks in lockstep ----------------------------------------------------
 * One thread per rank, each running the same command at once, as the ranks
 * of a job do; the caller's thread posts a command and waits for all. A
 * command's time runs from the first rank's start to the last rank's end,
 * as the ranks read the clock (not the caller, which may be descheduled on
 * a small machine). */
#define BENCH_MAX_RANKS 8

typedef struct bench_ranks bench_ranks;
typedef struct {
  bench_ranks *pool;
  int rank;
} bench_rank_arg;

struct bench_ranks {
  int world;
  int cpu; /* every rank thread pinned there (< 0: anywhere) */
  void (*body)(int rank, int cmd);
  int cmd; /* BENCH_RANKS_QUIT ends the threads */
  pthread_barrier_t start, end;
  pthread_t th[BENCH_MAX_RANKS];
  bench_rank_arg arg[BENCH_MAX_RANKS];
  double t_start[BENCH_MAX_RANKS], t_end[BENCH_MAX_RANKS];
};

#define BENCH_RANKS_QUIT (-1)

static inline void *bench_ranks_thread(void *a) {
  bench_ranks *p = ((bench_rank_arg *)a)->pool;
  int r = ((bench_rank_arg *)a)->rank;
  bench_pin(p->cpu);
  for (;;) {
    pthread_barrier_wait(&p->start);
    int c = p->cmd;
    p->t_start[r] = bench_now();
    if (c != BENCH_RANKS_QUIT)
      p->body(r, c);
    p->t_end[r] = bench_now();
    pthread_barrier_wait(&p->end);
    if (c == BENCH_RANKS_QUIT)
      return NULL;
  }
}

/* Starts world rank threads running body(rank, cmd) for each command. */
static inline void bench_ranks_start(bench_ranks *p, int world, int cpu,
                                     void (*body)(int rank, int cmd)) {
  if (world < 1 || world > BENCH_MAX_RANKS)
    bench_die("bench_ranks: %d ranks (1..%d)", world, BENCH_MAX_RANKS);
  p->world = world;
  p->cpu = cpu;
  p->body = body;
  pthread_barrier_init(&p->start, NULL, (unsigned)world + 1);
  pthread_barrier_init(&p->end, NULL, (unsigned)world + 1);
  for (int r = 0; r < world; r++) {
    p->arg[r] = (bench_rank_arg){p, r};
    if (pthread_create(&p->th[r], NULL, bench_ranks_thread, &p->arg[r]) != 0)
      bench_die("bench_ranks: pthread_create failed");
  }
}

/* Runs cmd on every rank; returns its time (see above). */
static inline double bench_ranks_run(bench_ranks *p, int cmd) {
  p->cmd = cmd;
  pthread_barrier_wait(&p->start);
  pthread_barrier_wait(&p->end);
  double lo = p->t_start[0], hi = p->t_end[0];
  for (int r = 1; r < p->world; r++) {
    lo = p->t_start[r] < lo ? p->t_start[r] : lo;
    hi = p->t_end[r] > hi ? p->t_end[r] : hi;
  }
  return hi - lo;
}

/* Ends and joins the rank threads. */
static inline void bench_ranks_stop(bench_ranks *p) {
  bench_ranks_run(p, BENCH_RANKS_QUIT);
  for (int r = 0; r < p->world; r++)
    pthread_join(p->th[r], NULL);
  pthread_barrier_destroy(&p->start);
  pthread_barrier_destroy(&p->end);
}

/* Starts BUILD/shardd on a fresh socket with the host backend, every one
 * of its threads on CPU cpu (< 0: anywhere), and waits until it answers a
 * control-session Hello. */
static inline void bench_daemon_start_on(bench_daemon *d, int devices,
                                         const char *devmem, int cpu) {
  static int counter;
  snprintf(d->socket, sizeof d->socket, "/tmp/shardd-bench-%d-%d.sock",
           (int)getpid(), counter++);
  unlink(d->socket);
  char bin[512], dev[16];
  snprintf(bin, sizeof bin, "%s/shardd", bench_build_dir());
  snprintf(dev, sizeof dev, "%d", devices);
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    /* the daemon's log goes to a file beside the results, not into tables */
    char log[1024];
    snprintf(log, sizeof log, "%s/shardd.log", bench_results_dir());
    FILE *lf = fopen(log, "a");
    if (lf)
      dup2(fileno(lf), 2);
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      sched_setaffinity(0, sizeof set, &set);
    }
    execl(bin, bin, "--socket", d->socket, "--backend", "host", "--devices",
          dev, "--device-memory", devmem, "--log-level", "warn", (char *)NULL);
    fprintf(stderr, "bench: exec %s: %s\n", bin, strerror(errno));
    _exit(127);
  }
  d->pid = pid;
  bench_track_daemon(pid, 1);
  for (int i = 0; i < 500; i++) {
    shardd_client_t *c;
    shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
    if (shardd_connect(d->socket, &o, &c, NULL, 0) == SHARDD_OK) {
      shardd_close(c);
      return;
    }
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid)
      bench_die("%s exited before it was ready (status %d)", bin, st);
    usleep(10000);
  }
  bench_die("%s did not come up on %s", bin, d->socket);
}

static inline void bench_daemon_start(bench_daemon *d, int devices,
                                      const char *devmem) {
  bench_daemon_start_on(d, devices, devmem, -1);
}

static inline void bench_daemon_stop(bench_daemon *d) {
  if (d->pid <= 0)
    return;
  kill(d->pid, SIGTERM);
  int st;
  waitpid(d->pid, &st, 0);
  bench_track_daemon(d->pid, 0);
  d->pid = 0;
  unlink(d->socket);
}

static inline shardd_client_t *bench_connect(const bench_daemon *d,
                                             const char *job, uint32_t rank,
                                             uint32_t world) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = rank;
  o.world = world;
  o.client_name = "bench";
  shardd_client_t *c;
  char err[512];
  if (shardd_connect(d->socket, &o, &c, err, sizeof err) != SHARDD_OK)
    bench_die("connect %s: %s", d->socket, err);
  return c;
}

static inline void *bench_alloc(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0)
    bench_die("out of memory (%zu bytes)", bytes);
  return p;
}

/* ---- streaming floors --------------------------------------------------- */

/* STREAM-style kernels over n floats. Bytes counted as STREAM counts them
 * (each array read or written once; write-allocate traffic not counted). */
typedef enum {
  FLOOR_COPY,  /* a = b            8 B/elem  (memcpy) */
  FLOOR_TRIAD, /* a = b + s*c     12 B/elem */
  FLOOR_RMW    /* a = a + s*b     12 B/elem, in place like an optimizer */
} bench_floor_kind;

static inline double bench_floor_bytes(bench_floor_kind k) {
  return k == FLOOR_COPY ? 8.0 : 12.0;
}

static inline void bench_floor_run(bench_floor_kind k, float *restrict a,
                                   const float *restrict b,
                                   const float *restrict c, size_t n) {
  const float s = 1.0001f;
  switch (k) {
  case FLOOR_COPY:
    memcpy(a, b, n * sizeof *a);
    break;
  case FLOOR_TRIAD:
    for (size_t i = 0; i < n; i++)
      a[i] = b[i] + s * c[i];
    break;
  case FLOOR_RMW:
    for (size_t i = 0; i < n; i++)
      a[i] = a[i] + s * b[i];
    break;
  }
}

typedef struct {
  pthread_barrier_t *start, *end;
  bench_floor_kind kind;
  float *a, *b, *c;
  size_t n;
  int reps;
  double *t0, *t1; /* [reps]: this thread's start and end of each run */
} bench_floor_arg;

static inline void *bench_floor_thread(void *p) {
  bench_floor_arg *a = p;
  for (int r = 0; r < a->reps; r++) {
    pthread_barrier_wait(a->start);
    a->t0[r] = bench_now();
    bench_floor_run(a->kind, a->a, a->b, a->c, a->n);
    a->t1[r] = bench_now();
    pthread_barrier_wait(a->end);
  }
  return NULL;
}

/* Median GB/s of kind over arrays a, b, c of n floats, split over nthreads
 * threads (each its own slice), reps timed runs after one warm-up. A run
 * lasts from the first thread's start to the last thread's end, each read
 * by the worker itself (the coordinating thread may be descheduled). */
static inline double bench_floor_on(bench_floor_kind kind, float *a, float *b,
                                    float *c, size_t n, int nthreads, int reps) {
  pthread_barrier_t start, end;
  pthread_barrier_init(&start, NULL, (unsigned)nthreads + 1);
  pthread_barrier_init(&end, NULL, (unsigned)nthreads + 1);
  pthread_t *th = calloc((size_t)nthreads, sizeof *th);
  bench_floor_arg *args = calloc((size_t)nthreads, sizeof *args);
  size_t per = (n / (size_t)nthreads) & ~(size_t)15;
  for (int t = 0; t < nthreads; t++) {
    size_t off = (size_t)t * per;
    size_t len = t == nthreads - 1 ? n - off : per;
    args[t] = (bench_floor_arg){&start, &end, kind, a + off, b + off, c + off,
                                len, reps + 1, calloc((size_t)reps + 1, sizeof(double)),
                                calloc((size_t)reps + 1, sizeof(double))};
    pthread_create(&th[t], NULL, bench_floor_thread, &args[t]);
  }
  double *s = calloc((size_t)reps, sizeof *s);
  for (int r = 0; r < reps + 1; r++) {
    pthread_barrier_wait(&start);
    pthread_barrier_wait(&end);
  }
  for (int t = 0; t < nthreads; t++)
    pthread_join(th[t], NULL);
  for (int r = 1; r < reps + 1; r++) {
    double lo = 1e300, hi = 0;
    for (int t = 0; t < nthreads; t++) {
      lo = args[t].t0[r] < lo ? args[t].t0[r] : lo;
      hi = args[t].t1[r] > hi ? args[t].t1[r] : hi;
    }
    s[r - 1] = hi - lo;
  }
  for (int t = 0; t < nthreads; t++) {
    free(args[t].t0);
    free(args[t].t1);
  }
  double med = bench_median(s, (size_t)reps);
  free(s);
  free(th);
  free(args);
  pthread_barrier_destroy(&start);
  pthread_barrier_destroy(&end);
  return (double)n * bench_floor_bytes(kind) / med / GB;
}

/* Three arrays of n floats for bench_floor_on, filled (and faulted in). */
static inline float *bench_floor_arrays(size_t n) {
  float *a = bench_alloc(n * 12);
  for (size_t i = 0; i < 3 * n; i++)
    a[i] = i < n ? 1.0f : i < 2 * n ? (float)(i & 1023) * 1e-3f : 0.5f;
  return a;
}

#endif /* SHARDD_BENCH_H */
