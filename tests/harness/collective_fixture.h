/* collective_fixture.h — the collective tests' shared daemon, team of
 * ranks and values (defined in harness_collective.c). */
#ifndef SHARDD_TEST_COLLECTIVE_FIXTURE_H
#define SHARDD_TEST_COLLECTIVE_FIXTURE_H

#include <pthread.h>
#include <stdint.h>

#include "daemon_fixture.h"
#include "harness.h"

#define MAXW 4

enum { OP_GATHER, OP_SCATTER, OP_STEP };

typedef struct {
  int world;
  shardd_client_t *c[MAXW];
} team;

typedef struct {
  shardd_client_t *c;
  int kind;
  uint64_t id;
  shardd_reduce_op op;
  shardd_step_opts so;
  shardd_step_result res;
  shardd_err rc;
  char msg[1024];
  pthread_t th;
} call;

typedef struct {
  shardd_optim_kind kind;
  double lr, momentum, dampening, wd, beta1, beta2, eps;
  int nesterov, amsgrad, maximize;
} ref_hp;

void start4(void);

/* The test that waits for the timeout on purpose takes this long; 5 s, so
 * that a rank thread that starts late on a loaded machine still arrives
 * before the timeout (the message must name only the rank never called). */
void start4_timeout(void);

void team_open(team *t, const char *job, int world);

void team_close(team *t);

void team_buffer(team *t, const char *name, shardd_dtype dt, uint64_t numel, shardd_buffer_info *out);

void team_view(team *t, uint64_t buf, const char *name, uint64_t off, uint64_t numel, const int64_t *shape, int ndim, uint64_t *id);

void team_optimizer(team *t, const char *name, shardd_optim_kind kind, const shardd_hparams *hp, const shardd_param_group *g, size_t ng, uint64_t *id);

void *call_main(void *p);

/* Runs calls[r] on ranks where calls[r].c is set, all at once; joins. */
void run_calls(call *calls, int n);

void team_all_res(team *t, int kind, uint64_t id, shardd_reduce_op op, const shardd_step_opts *so, shardd_step_result *res);

void team_all(team *t, int kind, uint64_t id, shardd_reduce_op op);

uint32_t mix(uint32_t x);

size_t esize(shardd_dtype dt);

/* A value +-(1 + m/128) * 2^e, e in [-2, 2]: exact in bf16, fp16 and fp32,
 * and sums of up to four of them are exact in fp32 (at most 12 significant
 * bits), while most are not representable in bf16. */
double grid_value(uint32_t h);

/* The bit pattern of a grid value, encoded by hand for each format. */
void put_grid(shardd_dtype dt, void *base, size_t i, uint32_t h);

float f32_at(const void *base, size_t i);

uint32_t f32_bits(float f);

/* bf16 round-to-nearest-even of a finite float, by the definition: the
 * nearer of the two neighbours with 8 significant bits, even on a tie. */
int representable_bf16(double v);

void fill_shards(const shardd_buffer_info *b, int world, uint32_t salt);

uint32_t grad_hash(int r, size_t j, uint32_t salt);

void fill_grads(const shardd_buffer_info *b, int world, uint32_t salt);

/* The reduced value of element j, in double (exact), then to float. */
float expected_reduced(int world, size_t j, uint32_t salt, int op);

void hp_set(shardd_hparams *o, const ref_hp *h);

float init_param(size_t j);

int status_steps(const char *job, const char *opt, double *steps);

int job_inflight(const char *job);

/* Opens r and says hello as rank of job on d, again until the daemon has
 * let the rank's earlier holder go (its Hello refused while it had not). */
void raw_hello_when_free(test_raw *r, const char *job, uint32_t rank, uint32_t world);

#endif
