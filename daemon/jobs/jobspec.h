/* jobspec.h — multi-node job layouts from --job-spec files: which job spans
 * how many nodes, which node this daemon is, and where the nodes meet.
 *
 * A spec is a text file of `key = value` lines (`#` starts a comment):
 *   job = llm-7b            the job it applies to (required)
 *   world = 8               ranks over all nodes (required)
 *   nodes = 2               daemons of the job, one per node (required)
 *   node_rank = 0           this daemon's node (required)
 *   local_ranks = 4         optional; must equal world / nodes
 *   rendezvous = /shared/x  a directory every node shares (required)
 *   host = 10.0.0.1         address this node's fabric listens on
 *                           (default 127.0.0.1)
 *   uid = 1000              optional: the spec is for that uid's job of
 *                           that name only (job names are per uid)
 * Without uid a spec is for one uid's job of that name at a time: while
 * one uid's job holds it, another uid's job of the name is refused (so a
 * spec never joins two users' jobs over the fabric); give it a uid on a
 * node shared by several users.
 * Node n's daemon holds the global ranks [n*L, (n+1)*L), L = world/nodes.
 * Jobs no spec names stay single-node as before.
 *
 * Ownership: specs are parsed once at start and live until exit. */
#ifndef SHARDD_JOBSPEC_H
#define SHARDD_JOBSPEC_H

#include <stddef.h>
#include <stdint.h>

#include "shardd.h"

typedef struct {
  char *path; /* the file it came from, for messages */
  char *job;
  uint32_t world, nodes, node_rank;
  char *rendezvous;
  char *host;
  int64_t uid; /* the job's owner; -1: not given (see above) */
} shardd__jobspec;

/* Parses path into *out (freed with shardd__jobspec_free); SHARDD_E_INVAL
 * with "path:line: reason" in err otherwise. */
shardd_err shardd__jobspec_load(const char *path, shardd__jobspec *out,
                                char *err, size_t errlen);
/* Parses the len bytes of text (a spec's contents; need not end in a NUL),
 * path naming it in messages and in out->path; as jobspec_load. */
shardd_err shardd__jobspec_parse(const char *path, const char *text,
                                 size_t len, shardd__jobspec *out, char *err,
                                 size_t errlen);
void shardd__jobspec_free(shardd__jobspec *s);

/* The spec for uid's job called job (one giving that uid, else one giving
 * none), or NULL. */
const shardd__jobspec *shardd__jobspec_find(const shardd__jobspec *specs,
                                            size_t n, uint32_t uid,
                                            const char *job);
/* Whether specs a and b could both apply to one job (same name, and
 * equal uids or either without one). */
int shardd__jobspec_overlap(const shardd__jobspec *a, const shardd__jobspec *b);

#endif /* SHARDD_JOBSPEC_H */
