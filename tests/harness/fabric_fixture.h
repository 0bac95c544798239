/* fabric_fixture.h — the multi-node tests' shared scratch, daemon pairs,
 * ranks and training run (defined in harness_fabric.c). */
#ifndef SHARDD_TEST_FABRIC_FIXTURE_H
#define SHARDD_TEST_FABRIC_FIXTURE_H

#include <pthread.h>
#include <stdint.h>

#include "harness.h"

#define W 4
#define STEPS 20
#define N_BIG 1030 /* shards of 258, 2 padding */
#define N_SMALL 6  /* shards of 2, 2 padding */

enum { OP_GATHER, OP_SCATTER, OP_STEP, OP_CHECKPOINT };

typedef struct {
  char dir[64]; /* holds the specs and the rendezvous directory */
  char rdv[128];
} scratch;

typedef struct {
  shardd_client_t *c;
  int kind;
  uint64_t id;
  shardd_step_opts so;
  shardd_step_result res;
  int sum; /* scatter with SHARDD_REDUCE_SUM instead of MEAN */
  const uint64_t *no_grad; /* scatter: this rank's views without a gradient */
  size_t nno_grad;
  const char *dir; /* checkpoint */
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} call;

typedef struct {
  size_t padded[2], shard[2];
  float *init_gather[2][W]; /* each rank's gather area after the first gather */
  float *reduced[2][W];     /* each rank's reduced shard after the first scatter */
  float *final_gather[2][W];
  double norms[STEPS];
} run_result;

void need_gloo(void);

void scratch_make(scratch *s);

void scratch_remove(scratch *s);

/* Writes the spec of job for node and returns its path in out. */
void write_spec(const scratch *s, const char *job, int node, char *out, size_t len);

/* Starts the two daemons of a 2-node layout serving jobs[0..njobs), node
 * 0's with the extra arguments extra0 (NULL-terminated; NULL: none). */
void start_pair_each(test_daemon d[2], const scratch *s, const char *const *jobs, int njobs, const char *timeout, const char *const *extra0, const char *const *extra1);

void start_pair_ex(test_daemon d[2], const scratch *s, const char *const *jobs, int njobs, const char *timeout, const char *const *extra0);

void start_pair(test_daemon d[2], const scratch *s, const char *const *jobs, int njobs, const char *timeout);

void *fabric_call_main(void *p);

void all_ranks(shardd_client_t **c, int kind, uint64_t id, double max_norm, shardd_step_result *res);

uint32_t fabric_mix(uint32_t x);

float unit(uint32_t a, uint32_t b, uint32_t c);

/* magnitude in [0.5, 1.5), random sign: 20 steps of lr 0.01 move a parameter
 * by at most ~0.2, so none comes near 0, where a relative difference would
 * measure cancellation in p - lr*u rather than fp32 rounding */
float fabric_init_param(int buf, size_t j);

/* positive, so a sum has no cancellation and fp32 rounding stays relative */
float grad_of(int buf, int step, int rank, size_t j);

float *copy_floats(const void *p, size_t n);

void result_free(run_result *r);

/* One training run of job over 4 ranks; rank r talks to d[r / per_daemon]. */
void train(const test_daemon *d, int per_daemon, const char *job, run_result *out);

double rel_diff(double a, double b);

uint32_t bits(float f);

double compare(const float *a, const float *b, size_t n, int exact, const char *what);

/* ---- the multi-node tests' per-test fixture and calls ----------------------
 * scr is each test's scratch (specs, rendezvous, checkpoints) under
 * .init = fabric_setup (which skips the test without Gloo), removed by
 * .fini = fabric_teardown. */
extern scratch scr;

void fabric_setup(void);

void fabric_teardown(void);

/* Ranks 0..n-1 of job (world W) connect, rank r to d[r / 2], and each
 * registers "w" of numel fp32: c[r], info[r]. */
void join_ranks_w(const test_daemon *d, const char *job, int n, uint64_t numel,
                  shardd_client_t **c, shardd_buffer_info *info);

/* Starts call k[r] of kind on c[r] for each rank r < n, each on its own
 * thread: on bufs[r] (a gather or scatter; NULL: none), or into
 * dirs[r / 2], each node's directory (a checkpoint; NULL: none). */
void calls_start(call *k, int n, shardd_client_t *const *c, int kind,
                 const shardd_buffer_info *bufs, const char *const *dirs);

void calls_join(call *k, int n);

/* kill -9 of node 1's daemon, reaped (its pid 0 after). */
void kill_node1(test_daemon pair[2]);

#endif
