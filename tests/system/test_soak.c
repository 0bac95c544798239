/* test_soak.c — bounded soak on loopback: 16 jobs x 4 rank processes (64
 * clients) register, gather, scatter, step and unregister in random
 * (per-job seeded) order while the test kills rank processes at random;
 * survivors check every gathered value against a reference they compute
 * themselves, killed jobs are restarted under a new name. Afterwards the
 * daemon must be alive, list no job and account 0 bytes on every device.
 * SOAK_SECONDS sets the length (default 20 s, 60 s when CI=true).
 *
 * A killed rank's peers learn of it by its disconnect: a collective it was
 * in fails at once, one they enter after it died once --peer-grace is
 * over. The collective timeout can also end a collective of a job
 * nobody killed when a rank process is descheduled for that long (64 of
 * them on 2 cores under the sanitizers): such a job's ranks exit
 * RANK_TIMEOUT, it counts as stalled, not as a wrong answer, and the
 * disconnects that follow in it are expected. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define JOBS 16
#define RANKS 4

typedef struct {
  atomic_int stop;
  atomic_long requests;
  atomic_long steps;
  atomic_long refusals;
} shared_state;

static shared_state *shm;

static uint32_t lcg(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

/* Exit codes of a rank process. */
enum { RANK_OK = 0, RANK_WRONG = 2, RANK_LOST = 3, RANK_SETUP = 4, RANK_TIMEOUT = 5 };

#define CALL(expr)                                                           \
  do {                                                                       \
    atomic_fetch_add(&shm->requests, 1);                                     \
    shardd_err rc_ = (expr);                                                 \
    if (rc_ != SHARDD_OK && rc_ != SHARDD_E_PEER_LOST && !atomic_load(&shm->stop)) \
      fprintf(stderr, "soak: %s: %s: %s\n", #expr, shardd_err_name(rc_),    \
              shardd_last_error(c));                                         \
    if (rc_ != SHARDD_OK)                                                    \
      _exit(atomic_load(&shm->stop)         ? RANK_OK                        \
            : rc_ != SHARDD_E_PEER_LOST     ? RANK_WRONG                     \
            : strstr(shardd_last_error(c), "timed out") ? RANK_TIMEOUT       \
                                            : RANK_LOST);                    \
  } while (0)

static float value_of(shardd_dtype dt, const void *area, uint64_t i) {
  if (dt == SHARDD_DTYPE_FP32)
    return ((const float *)area)[i];
  uint32_t u = (uint32_t)((const uint16_t *)area)[i] << 16; /* bf16 */
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void set_value(shardd_dtype dt, void *area, uint64_t i, float v) {
  if (dt == SHARDD_DTYPE_FP32) {
    ((float *)area)[i] = v;
  } else {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    ((uint16_t *)area)[i] = (uint16_t)(u >> 16); /* small integers: exact */
  }
}

/* One rank of one job, until the stop flag: every rank draws the same
 * sequence from the job's seed, so they make the same collective calls. */
static void rank_main(const char *sock, const char *job, uint32_t rank,
                      uint32_t seed) {
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = job;
  o.rank = rank;
  o.world = RANKS;
  shardd_client_t *c;
  char err[256];
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK) {
    fprintf(stderr, "soak: connect %s rank %u: %s\n", job, rank, err);
    _exit(RANK_SETUP);
  }
  for (int iter = 0; !atomic_load(&shm->stop); iter++) {
    uint32_t r = seed + (uint32_t)iter * 7919u;
    uint64_t numel = 1 + lcg(&r) % 6000;
    shardd_dtype dt = lcg(&r) % 2 ? SHARDD_DTYPE_FP32 : SHARDD_DTYPE_BF16;
    int steps = 1 + (int)(lcg(&r) % 4);
    uint64_t split = numel > 1 ? 1 + lcg(&r) % (numel - 1) : 0;
    char name[32];
    snprintf(name, sizeof name, "b%d", iter);
    shardd_buffer_info b;
    CALL(shardd_buffer_register(c, name, dt, numel, &b));
    for (uint64_t i = 0; i < b.shard_numel; i++) {
      uint64_t g = rank * b.shard_numel + i;
      set_value(dt, b.shard, i, g < numel ? (float)(g % 64) + 16 : 0.0f);
    }
    uint64_t v[2] = {0, 0};
    int nv = 0;
    if (split) {
      int64_t s0[1] = {(int64_t)split}, s1[1] = {(int64_t)(numel - split)};
      CALL(shardd_view_register(c, b.id, "lo", 0, split, s0, 1, &v[nv++]));
      CALL(shardd_view_register(c, b.id, "hi", split, numel - split, s1, 1, &v[nv++]));
    } else {
      v[nv++] = b.id; /* a one-element buffer is referenced whole */
    }
    shardd_param_ref refs[3] = {{v[0], "lo"}, {v[1], "hi"}, {0, "stray"}};
    shardd_param_group g = {refs, (size_t)nv, {0}};
    shardd_hparams hp = {.set = SHARDD_HP_LR, .lr = 1.0};
    uint64_t opt;
    snprintf(name, sizeof name, "o%d", iter);
    /* A refusal first: a stray tensor, then the real registration. */
    shardd_param_group bad = {refs, 3, {0}};
    atomic_fetch_add(&shm->requests, 1);
    /* Another rank may have registered the real one already: then the
     * refusal also names the views as taken; the stray must be named. */
    if (nv == 2 && (shardd_optimizer_register(c, "bad", SHARDD_OPTIM_SGD, &hp, &bad, 1,
                                              &opt) == SHARDD_OK ||
                    !strstr(shardd_last_error(c), "(\"stray\"): not a shardd"))) {
      fprintf(stderr, "soak: %s: the stray ref was not refused: %s\n", job,
              shardd_last_error(c));
      _exit(RANK_WRONG);
    }
    atomic_fetch_add(&shm->refusals, 1);
    CALL(shardd_optimizer_register(c, name, SHARDD_OPTIM_SGD, &hp, &g, 1, &opt));

    float shift = 0; /* what the steps took off every element so far */
    for (int s = 0; s <= steps; s++) {
      CALL(shardd_gather(c, b.id));
      for (uint64_t i = 0; i < b.padded_numel; i++) {
        float want = i < numel ? (float)(i % 64) + 16 - shift : 0.0f;
        if (value_of(dt, b.gather, i) != want) {
          fprintf(stderr, "soak: %s rank %u iter %d step %d: element %llu is %g, want %g\n",
                  job, rank, iter, s, (unsigned long long)i,
                  (double)value_of(dt, b.gather, i), (double)want);
          _exit(RANK_WRONG);
        }
      }
      if (s == steps)
        break;
      float grad = (float)(1 + (s % 2)); /* every rank the same: mean = it */
      for (uint64_t i = 0; i < b.padded_numel; i++)
        set_value(dt, b.grad, i, grad);
      CALL(shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN));
      CALL(shardd_step(c, opt, NULL, NULL));
      atomic_fetch_add(&shm->steps, 1);
      shift += grad;
    }
    /* Rank 0 unregisters only once every rank is done reading: one more
     * collective on a per-iteration barrier buffer says so. Unregistering
     * frees every rank's block, punched out of every mapping, so a rank
     * still checking its last gather would read zeros. */
    snprintf(name, sizeof name, "sync%d", iter);
    shardd_buffer_info sb;
    CALL(shardd_buffer_register(c, name, SHARDD_DTYPE_FP32, 1, &sb));
    CALL(shardd_gather(c, sb.id));
    if (rank == 0) {
      CALL(shardd_optimizer_unregister(c, opt));
      CALL(shardd_buffer_unregister(c, b.id));
      CALL(shardd_buffer_unregister(c, sb.id));
    }
  }
  shardd_close(c);
  _exit(RANK_OK);
}

/* No job listed and 0 bytes used on every device. */
static int status_is_empty(const char *json) {
  tj *st = tj_parse(json);
  cr_assert_not_null(st, "status is not JSON: %s", json);
  int empty = tj_need(st, "jobs", TJ_ARR)->n == 0;
  const tj *devs = tj_need(st, "devices", TJ_ARR);
  for (size_t i = 0; i < devs->n; i++)
    if (tj_need(devs->kids[i], "used_bytes", TJ_NUM)->num != 0)
      empty = 0;
  tj_free(st);
  return empty;
}

typedef struct {
  pid_t pid[RANKS];
  int alive;
  int killed;   /* a rank was killed: the others may exit RANK_LOST */
  int lost;     /* ranks that exited RANK_LOST */
  int timeouts; /* ranks that exited RANK_TIMEOUT: then RANK_LOST is expected too */
  int generation;
} job_slot;

/* Tallies one exited rank of j: a wrong answer, or a loss or timeout that
 * settle_job judges once the job is over. */
static void rank_exited(job_slot *j, int st, long *wrong) {
  int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  int was_killed = WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL;
  if (code == RANK_WRONG || code == RANK_SETUP)
    (*wrong)++;
  else if (code == RANK_LOST)
    j->lost++;
  else if (code == RANK_TIMEOUT)
    j->timeouts++;
  else if (!was_killed && code != RANK_OK)
    (*wrong)++;
}

/* A job nobody killed and that no timeout ended must lose no rank. */
static void settle_job(const job_slot *j, long *lost_unexpected, long *stalled) {
  if (j->killed)
    return;
  if (j->timeouts > 0)
    (*stalled)++;
  else
    *lost_unexpected += j->lost;
}

static void start_job(const test_daemon *d, job_slot *j, int index) {
  char name[64];
  snprintf(name, sizeof name, "soak%d-g%d", index, j->generation);
  uint32_t seed = (uint32_t)(index * 1000003 + j->generation * 7);
  j->killed = 0;
  j->lost = 0;
  j->timeouts = 0;
  j->alive = RANKS;
  for (uint32_t r = 0; r < RANKS; r++) {
    pid_t p = fork();
    cr_assert(p >= 0);
    if (p == 0)
      rank_main(d->sock, name, r, seed);
    j->pid[r] = p;
  }
}

Test(soak, many_jobs_with_kills_leak_nothing, .timeout = 240) {
  const char *env = getenv("SOAK_SECONDS");
  const char *ci = getenv("CI");
  double secs = env ? atof(env) : (ci && !strcmp(ci, "true") ? 60 : 20);
  shm = mmap(NULL, sizeof *shm, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
             -1, 0);
  cr_assert_neq(shm, MAP_FAILED);
  memset(shm, 0, sizeof *shm);

  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", "--job-linger", "0",
                                              "--collective-timeout", "5", "--log-level",
                                              getenv("SOAK_LOG") ? getenv("SOAK_LOG") : "warn", NULL});
  job_slot jobs[JOBS];
  memset(jobs, 0, sizeof jobs);
  for (int j = 0; j < JOBS; j++)
    start_job(&d, &jobs[j], j);

  uint32_t rng = 4242;
  long kills = 0, wrong = 0, lost_unexpected = 0, stalled = 0;
  double start = test_mono_s(), next_kill = start + 0.5;
  while (test_mono_s() - start < secs) {
    int st;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p > 0) {
      for (int j = 0; j < JOBS; j++)
        for (int r = 0; r < RANKS; r++)
          if (jobs[j].pid[r] == p) {
            jobs[j].pid[r] = 0;
            rank_exited(&jobs[j], st, &wrong);
            if (--jobs[j].alive == 0) { /* the whole job is gone: a new one */
              settle_job(&jobs[j], &lost_unexpected, &stalled);
              jobs[j].generation++;
              start_job(&d, &jobs[j], j);
            }
          }
      continue;
    }
    if (test_mono_s() >= next_kill) {
      int j = (int)(lcg(&rng) % JOBS), r = (int)(lcg(&rng) % RANKS);
      if (jobs[j].pid[r] > 0) {
        kill(jobs[j].pid[r], SIGKILL);
        jobs[j].killed = 1;
        kills++;
      }
      next_kill = test_mono_s() + 0.3 + (lcg(&rng) % 1000) / 1000.0;
    }
    test_sleep_ms(5);
  }
  /* Ranks exit RANK_OK once they see the flag (or come out of a collective
   * with it set); one killed in the loop's last turn is reaped here. */
  atomic_store(&shm->stop, 1);
  for (int j = 0; j < JOBS; j++) {
    for (int r = 0; r < RANKS; r++)
      if (jobs[j].pid[r] > 0) {
        int st;
        waitpid(jobs[j].pid[r], &st, 0);
        jobs[j].pid[r] = 0;
        rank_exited(&jobs[j], st, &wrong);
      }
    settle_job(&jobs[j], &lost_unexpected, &stalled);
  }
  cr_assert(test_daemon_alive(&d), "the daemon died during the soak");
  cr_assert_eq(wrong, 0, "%ld rank(s) saw wrong numbers or a wrong answer", wrong);
  cr_assert_eq(lost_unexpected, 0, "%ld rank(s) lost a peer nobody killed",
               lost_unexpected);
  cr_assert_gt(kills, 0);

  /* Everything released: no job, no byte, by the daemon's own accounting. */
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 0);
  char *json = NULL;
  int clean = 0;
  for (double end = test_mono_s() + TEST_HANG_S; !clean && test_mono_s() < end;) {
    shardd_free(json);
    json = NULL;
    cr_assert_eq(shardd_status_json(ctl, &json), SHARDD_OK);
    clean = status_is_empty(json);
    if (!clean)
      test_sleep_ms(50);
  }
  cr_log_info("soak: %.0f s, %ld requests, %ld steps, %ld refusals, %ld clients killed, "
              "%ld jobs stalled to the collective timeout; status after: %s", secs,
              atomic_load(&shm->requests), atomic_load(&shm->steps),
              atomic_load(&shm->refusals), kills, stalled, json);
  fprintf(stderr, "soak: %.0f s, %ld requests, %ld steps, %ld refusals, %ld clients killed, "
          "%ld jobs stalled\n", secs, atomic_load(&shm->requests), atomic_load(&shm->steps),
          atomic_load(&shm->refusals), kills, stalled);
  cr_assert(clean, "leaked after the soak: %s", json);
  shardd_free(json);
  shardd_close(ctl);
  cr_assert_eq(test_daemon_stop(&d), 0);
}
