/* checkpoint_fixture.h — the checkpoint tests' shared scratch directory,
 * registry and helpers (defined in harness_checkpoint.c). */
#ifndef SHARDD_TEST_CHECKPOINT_FIXTURE_H
#define SHARDD_TEST_CHECKPOINT_FIXTURE_H

#include <pthread.h>
#include <stdint.h>

#include "backend.h"
#include "harness.h"
#include "registry.h"

/* A byte image of everything a checkpoint must keep. */
typedef struct {
  unsigned char *bytes;
  size_t len;
} image;

typedef struct {
  const test_daemon *d;
  uint32_t rank, world;
  int steps;      /* steps to run */
  int first_step; /* gradient seed offset, so both runs see the same grads */
  int global_grad; /* rank 0 writes one global gradient, the others 0, SUM:
                    * the reduced gradient is the same in any world */
  const char *ckpt; /* checkpoint after the steps (rank 0 asks) */
  float *out;     /* NUMEL + HALF floats: the gathered parameters at the end */
  pthread_barrier_t *bar;
  int *progress;  /* not NULL: rank 0 stores the steps it has taken */
} rank_arg;

extern char dir[64];

extern shardd__backend *be;

extern shardd__registry reg;

void rm_tree(const char *path);

void setup(void);

void teardown(void);

extern uint32_t rng;

uint32_t next_rand(void);

void fill_random(void *p, size_t bytes);

/* A job with an fp32 and a bf16 buffer, views in both, one AdamW over the
 * views and the whole of nothing else; shards and state filled randomly. */
shardd__job *make_job(const char *name);

void image_add(image *im, const void *p, size_t n);

image snapshot(shardd__job *job);

/* The name of in's data file that starts "prefix-" (each checkpoint tags
 * its files: b0-r0-TAG.shard), in out; "manifest" stays as it is. */
void data_name(const char *in, const char *prefix, char *out, size_t n);

/* Seals an edited manifest again as shardd does (its "end" line carries
 * the CRC32C of the bytes before it), so a test of what the parser refuses
 * reaches the parser. */
void reseal(const char *path);

void write_text(const char *path, const char *text);

#define WORLD 2

#define MAXW 4

#define NUMEL 1003

#define HALF 301

void grad_for(int step, uint32_t rank, float *g, uint64_t n);

uint16_t to_bf16(float f);

float from_bf16(uint16_t h);

void *run_rank(void *p);

void run_world(const test_daemon *d, uint32_t world, int global_grad, int steps, int first, const char *ckpt, float *out);

void run_job(const test_daemon *d, int steps, int first, const char *ckpt, float *out);

/* The steps of the (one) optimizer of the daemon's only job. */
uint64_t job_steps(const test_daemon *d);

/* An SGD optimizer over buffer buf on raw client r; its id. */
uint64_t raw_sgd(test_raw *r, uint64_t buf);

#endif
