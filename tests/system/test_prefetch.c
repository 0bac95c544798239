/* test_prefetch.c — shardd_gather_async / shardd_wait: prefetched gathers
 * complete with the right contents while other calls are made in between,
 * their number in flight is bounded (the client's max_inflight_gathers and
 * the daemon's --max-inflight-gathers), and a prefetched gather overlaps the
 * trainer's compute: the daemon fills the gather area while the trainer
 * makes no libshardd call at all. That is shown structurally, by watching
 * the shared mapping fill, never by timing (bench/prefetch_bench.c measures
 * how much time the overlap saves). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <time.h>

#include "harness.h"

#define LAYERS 6
#define NUMEL 5001

typedef struct {
  const test_daemon *d;
  uint32_t rank;
  int failures;
} rank_arg;

/* Layer l holds 1000*l + element index; each rank writes its shard. */
static void *prefetch_rank(void *p) {
  rank_arg *a = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "prefetch";
  o.rank = a->rank;
  o.world = 2;
  o.max_inflight_gathers = 2;
  shardd_client_t *c;
  char err[256];
  cr_assert_eq(shardd_connect(a->d->sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_buffer_info b[LAYERS];
  for (int l = 0; l < LAYERS; l++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d", l);
    cr_assert_eq(shardd_buffer_register(c, name, SHARDD_DTYPE_FP32, NUMEL, &b[l]), SHARDD_OK);
    for (uint64_t i = 0; i < b[l].shard_numel; i++) {
      uint64_t g = a->rank * b[l].shard_numel + i;
      ((float *)b[l].shard)[i] = g < NUMEL ? (float)(1000 * l) + (float)g : 0.0f;
    }
  }
  shardd_ticket t[LAYERS];
  cr_assert_eq(shardd_gather_async(c, b[0].id, &t[0]), SHARDD_OK, "%s", shardd_last_error(c));
  for (int l = 0; l < LAYERS; l++) {
    if (l + 1 < LAYERS)
      cr_assert_eq(shardd_gather_async(c, b[l + 1].id, &t[l + 1]), SHARDD_OK, "%s",
                   shardd_last_error(c));
    cr_assert_eq(shardd_ping(c), SHARDD_OK); /* other calls in between */
    cr_assert_eq(shardd_wait(c, t[l]), SHARDD_OK, "%s", shardd_last_error(c));
    for (uint64_t i = 0; i < NUMEL; i++)
      if (((float *)b[l].gather)[i] != (float)(1000 * l) + (float)i)
        a->failures++;
  }
  cr_assert_eq(shardd_wait(c, t[0]), SHARDD_E_INVAL, "a ticket is waited for once");
  shardd_close(c);
  return NULL;
}

Test(prefetch, async_gathers_complete_in_any_interleaving, .timeout = 120) {
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  pthread_t th[2];
  rank_arg a[2] = {{&d, 0, 0}, {&d, 1, 0}};
  for (int r = 0; r < 2; r++)
    pthread_create(&th[r], NULL, prefetch_rank, &a[r]);
  for (int r = 0; r < 2; r++)
    pthread_join(th[r], NULL);
  cr_assert_eq(a[0].failures + a[1].failures, 0, "wrong gathered elements");
  cr_assert_eq(test_daemon_stop(&d), 0);
}

Test(prefetch, daemon_bounds_gathers_in_flight, .timeout = 120) {
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--max-inflight-gathers", "3", NULL});
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "bounded";
  o.rank = 0;
  o.world = 2; /* rank 1 never comes: the gathers stay queued */
  o.max_inflight_gathers = 100;
  shardd_client_t *c;
  char err[256];
  cr_assert_eq(shardd_connect(d.sock, &o, &c, err, sizeof err), SHARDD_OK, "%s", err);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "x", SHARDD_DTYPE_FP32, 10, &b), SHARDD_OK);
  shardd_ticket t[4];
  for (int i = 0; i < 4; i++)
    cr_assert_eq(shardd_gather_async(c, b.id, &t[i]), SHARDD_OK);
  /* The fourth is refused at once; the first three still wait for rank 1. */
  cr_assert_eq(shardd_wait(c, t[3]), SHARDD_E_LIMIT);
  cr_assert(strstr(shardd_last_error(c), "--max-inflight-gathers 3") != NULL, "%s",
            shardd_last_error(c));
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}


/* FSDP's forward prefetch over two ranks: layer l+1's gather is sent, then
 * the trainer computes on layer l. On the host backend each rank's gather
 * area is a shared mapping of the daemon's memory, so the trainer can watch
 * it: every area is poisoned before its gather is sent, and the compute is
 * a loop that only reads memory -- no libshardd call, so not one byte of the
 * socket is read -- until layer l+1's area holds the whole gathered buffer,
 * the other rank's shard included, which nothing but the daemon can have
 * copied there. Only then does shardd_wait collect the reply. The deadline
 * turns a gather that never lands without a call (no overlap) into a
 * failure instead of a hang; nothing here depends on how long anything
 * takes. */
#define OV_LAYERS 6
#define OV_NUMEL (3u * 65536u + 5u) /* odd: the last shard has padding */
#define OV_POISON 0x7fc0deadu       /* a NaN no layer holds */
#define OV_DEADLINE_S 20

/* What layer's gathered element g must hold, as float bits: distinct per
 * layer and element (exact integers below 2^24), 0 in the padding. */
static uint32_t ov_bits(int layer, uint64_t g) {
  float v = g < OV_NUMEL ? (float)(((uint32_t)layer << 20) + (uint32_t)g) : 0.0f;
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* Set by the first rank that fails, so that the other stops watching at
 * once instead of waiting out the deadline for a gather its partner will
 * never send; ov_why keeps that first failure, the cause. */
static atomic_int ov_abort;
static char ov_why[512];

typedef struct {
  const test_daemon *d;
  uint32_t rank;
  int watched_in_flight; /* layers first seen still poisoned (a log line) */
} ov_arg;

static int ov_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ov_fail(const char *fmt, ...) {
  if (atomic_exchange(&ov_abort, 1) == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ov_why, sizeof ov_why, fmt, ap);
    va_end(ap);
  }
  return 0;
}

/* Poisons the gather area through the client's mapping and reads it back:
 * the mapping must be writable for the watch below to mean anything. */
static int ov_poison(ov_arg *a, const shardd_buffer_info *b, int layer) {
  volatile uint32_t *g = b->gather;
  for (uint64_t i = 0; i < b->padded_numel; i++)
    g[i] = OV_POISON;
  for (uint64_t i = 0; i < b->padded_numel; i++)
    if (g[i] != OV_POISON)
      return ov_fail("rank %u layer %d: the gather area does not keep what the "
                        "client writes (element %llu)",
                     a->rank, layer, (unsigned long long)i);
  return 1;
}

/* The trainer's compute: reads the gather area, calling nothing, until it
 * holds layer's whole gathered buffer. An element once right stays right
 * (only the gather writes there), so each pass resumes where the last
 * stopped. */
static int ov_watch(ov_arg *a, const shardd_buffer_info *b, int layer) {
  const volatile uint32_t *g = b->gather;
  uint64_t next = 0;
  int first = 1;
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  time_t give_up = now.tv_sec + OV_DEADLINE_S;
  for (;;) {
    while (next < b->padded_numel && g[next] == ov_bits(layer, next))
      next++;
    if (next == b->padded_numel) {
      atomic_thread_fence(memory_order_acquire);
      return 1;
    }
    uint32_t seen = g[next];
    if (first && seen == OV_POISON)
      a->watched_in_flight++;
    first = 0;
    if (atomic_load(&ov_abort))
      return 0;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec > give_up)
      return ov_fail("rank %u layer %d: without a libshardd call the gather area never "
                        "held the buffer: element %llu (rank %llu's shard) is 0x%08x, "
                        "expected 0x%08x%s",
                     a->rank, layer, (unsigned long long)next,
                     (unsigned long long)(next / b->shard_numel), seen, ov_bits(layer, next),
                     seen == OV_POISON ? " (still the poison: the daemon did not gather)" : "");
    /* leave the CPU to the daemon's pool on a small machine */
    test_sleep_ms(1);
  }
}

static int ov_intact(ov_arg *a, const shardd_buffer_info *b, int layer) {
  const uint32_t *g = b->gather;
  for (uint64_t i = 0; i < b->padded_numel; i++)
    if (g[i] != ov_bits(layer, i))
      return ov_fail("rank %u layer %d: element %llu changed to 0x%08x while the next "
                        "layer was gathered",
                     a->rank, layer, (unsigned long long)i, g[i]);
  return 1;
}

static void *ov_rank(void *p) {
  ov_arg *a = p;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = "overlap";
  o.rank = a->rank;
  o.world = 2;
  o.max_inflight_gathers = 2;
  shardd_client_t *c;
  char err[256];
  if (shardd_connect(a->d->sock, &o, &c, err, sizeof err) != SHARDD_OK) {
    ov_fail("rank %u: connect: %s", a->rank, err);
    return NULL;
  }
  shardd_buffer_info b[OV_LAYERS];
  shardd_ticket t[OV_LAYERS];
  int ok = 1;
  for (int l = 0; ok && l < OV_LAYERS; l++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d", l);
    if (shardd_buffer_register(c, name, SHARDD_DTYPE_FP32, OV_NUMEL, &b[l]) != SHARDD_OK) {
      ok = ov_fail("rank %u: register %s: %s", a->rank, name, shardd_last_error(c));
      break;
    }
    if (b[l].is_device) {
      ok = ov_fail("rank %u: %s is device memory: not the host backend", a->rank, name);
      break;
    }
    uint32_t *s = b[l].shard;
    for (uint64_t i = 0; i < b[l].shard_numel; i++)
      s[i] = ov_bits(l, a->rank * b[l].shard_numel + i);
  }
  /* Layer 0 has nothing to overlap with but is watched the same way. */
  if (ok && ov_poison(a, &b[0], 0)) {
    if (shardd_gather_async(c, b[0].id, &t[0]) != SHARDD_OK)
      ok = ov_fail("rank %u: gather_async layer 0: %s", a->rank, shardd_last_error(c));
    else if (!ov_watch(a, &b[0], 0))
      ok = 0;
    else if (shardd_wait(c, t[0]) != SHARDD_OK)
      ok = ov_fail("rank %u: wait layer 0: %s", a->rank, shardd_last_error(c));
  } else {
    ok = 0;
  }
  for (int l = 0; ok && l + 1 < OV_LAYERS; l++) {
    int n = l + 1;
    if (!ov_poison(a, &b[n], n)) {
      ok = 0;
    } else if (shardd_gather_async(c, b[n].id, &t[n]) != SHARDD_OK) {
      ok = ov_fail("rank %u: gather_async layer %d: %s", a->rank, n, shardd_last_error(c));
    } else if (!ov_intact(a, &b[l], l) || !ov_watch(a, &b[n], n) ||
               !ov_intact(a, &b[l], l)) {
      /* the compute on layer l, reading it while layer n lands */
      ok = 0;
    } else if (shardd_wait(c, t[n]) != SHARDD_OK) {
      ok = ov_fail("rank %u: wait layer %d: %s", a->rank, n, shardd_last_error(c));
    } else if (!ov_intact(a, &b[n], n)) {
      ok = 0; /* the wait changes nothing: the bytes were all there */
    }
  }
  shardd_close(c);
  return NULL;
}

Test(prefetch, prefetched_gather_lands_while_the_trainer_computes, .timeout = 120) {
  test_daemon d;
  /* the host backend: gather areas are host mappings the test can watch */
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--devices", "2", NULL});
  atomic_store(&ov_abort, 0);
  ov_why[0] = '\0';
  pthread_t th[2];
  ov_arg a[2] = {{.d = &d, .rank = 0}, {.d = &d, .rank = 1}};
  for (int r = 0; r < 2; r++)
    cr_assert_eq(pthread_create(&th[r], NULL, ov_rank, &a[r]), 0);
  for (int r = 0; r < 2; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++)
    cr_log_info("rank %d: %d of %d layers seen in flight (still poisoned) when watched", r,
                a[r].watched_in_flight, OV_LAYERS);
  cr_assert_str_empty(ov_why, "%s", ov_why);
  cr_assert_eq(test_daemon_stop(&d), 0);
}
