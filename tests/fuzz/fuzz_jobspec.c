/* fuzz_jobspec.c — libFuzzer target for the --job-spec parser
 * (shardd__jobspec_parse, the in-memory half of shardd__jobspec_load).
 * Each input is a spec's text. A spec the parser accepts must hold what
 * jobs.c relies on without checking again: a job name, a world that splits
 * evenly over nodes, node_rank below nodes, a host, a rendezvous when it
 * spans nodes, and shardd__jobspec_find must return it for its own name
 * and uid. A refused one must leave nothing allocated (ASan's leak check)
 * and a message naming the file. Seeds: tests/fuzz/corpus_jobspec/. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jobspec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  shardd__jobspec s;
  char err[512];
  shardd_err rc = shardd__jobspec_parse("fuzz.spec", (const char *)data, size, &s,
                                        err, sizeof err);
  if (rc != SHARDD_OK) {
    if (rc != SHARDD_E_INVAL || strncmp(err, "fuzz.spec:", 10) != 0 || s.job != NULL)
      abort();
    return 0;
  }
  if (s.job == NULL || s.host == NULL || s.path == NULL || s.nodes < 1 ||
      s.world < s.nodes || s.world % s.nodes != 0 || s.node_rank >= s.nodes ||
      s.world > 65536 || (s.nodes > 1 && s.rendezvous == NULL) ||
      s.uid < -1 || s.uid > (int64_t)UINT32_MAX)
    abort();
  uint32_t uid = s.uid < 0 ? 4242u : (uint32_t)s.uid;
  if (shardd__jobspec_find(&s, 1, uid, s.job) != &s || !shardd__jobspec_overlap(&s, &s))
    abort();
  if (s.uid >= 0 && shardd__jobspec_find(&s, 1, uid + 1, s.job) != NULL)
    abort(); /* a spec with a uid is that uid's only */
  shardd__jobspec_free(&s);
  return 0;
}
