/* fuzz_manifest.c — libFuzzer target for the checkpoint manifest parser and
 * the restore it drives. Each input is a manifest; it is written into a
 * scratch checkpoint directory that holds no data files (shard and state
 * lines reach the open and fail there: the data file checks have their own
 * tests in test_checkpoint.c), and restored with the daemon's own rights. A restored job is released again,
 * so every input starts from an empty registry. The bug this target was
 * written for: a manifest without a job line restored nothing, returned OK,
 * and the callers used the NULL job. */
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "checkpoint.h"
#include "registry.h"
#include "fuzz_util.h"

static shardd__registry reg;
static char manifest[128];

static void init_once(void) {
  static int done;
  if (done)
    return;
  done = 1;
  char err[256];
  shardd__backend *b;
  if (shardd__backend_host_create(2, 64u << 20, &b, err, sizeof err) != SHARDD_OK)
    abort();
  shardd__registry_init(&reg, b);
  snprintf(root, sizeof root, "/tmp/shardd-fuzzm-%d.d", (int)getpid());
  mkdir(root, 0700);
  atexit(fuzz_rm_root);
  snprintf(manifest, sizeof manifest, "%s/manifest", root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  init_once();
  int fd = open(manifest, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0)
    abort();
  for (size_t off = 0; off < size;) {
    ssize_t w = write(fd, data + off, size - off);
    if (w <= 0)
      abort();
    off += (size_t)w;
  }
  close(fd);
  char err[1024];
  shardd__job *job = (shardd__job *)&reg; /* must be set: NULL or a job */
  shardd_err rc = shardd__checkpoint_restore(&reg, root, -1, 0, &job, err, sizeof err);
  if (rc == SHARDD_OK) {
    if (job == NULL)
      abort(); /* OK with no job: what crashed the daemon */
    shardd__job_release(&reg, job);
  } else if (job != NULL) {
    abort();
  }
  if (shardd__map_count(&reg.jobs) != 0)
    abort(); /* a refused restore left its job */
  return 0;
}
