/* registry_int.h — what the registry's files (registry.h names them)
 * share: object ids, name checks, per-name generations, the freed-handle
 * record, quotas, the area layout and the destructors job_release calls.
 * Only those files include it; every other module goes through registry.h, so these
 * can change without touching a caller outside the registry. Loop thread
 * only, as the registry. */
#ifndef SHARDD_REGISTRY_INT_H
#define SHARDD_REGISTRY_INT_H

#include <stddef.h>
#include <stdint.h>

#include "map.h"
#include "registry.h"
#include "shardd.h"

/* ---- registry.c ------------------------------------------------------- */

/* Whether name is usable as the name of a what ("job", "buffer", "view");
 * else 0 with err saying why. */
int shardd__name_ok(const char *name, const char *what, char *err,
                    size_t errlen);

/* Gives o the next id and lists it in reg's id map; o->name becomes a copy
 * of name, freed by obj_fini. On SHARDD_E_NO_MEMORY o is not listed, its
 * name is NULL and no id was spent. */
shardd_err shardd__obj_init(shardd__registry *reg, shardd__obj *o,
                            shardd__obj_kind kind, const char *name,
                            shardd__job *job);
/* As shardd__obj_init, with name in o's own allocation (it lives as o
 * does; obj_fini does not free it): a view's name is a strdup and a free
 * less. */
shardd_err shardd__obj_init_inline(shardd__registry *reg, shardd__obj *o,
                                   shardd__obj_kind kind, char *name,
                                   shardd__job *job);
/* Unlists o and frees its name (unless inline); o itself stays the caller's. Safe on an o
 * that obj_init never listed (name NULL). */
void shardd__obj_fini(shardd__registry *reg, shardd__obj *o);

/* The gens key of a buffer name (view_name NULL) or of a view of it;
 * caller frees; NULL when out of memory. */
char *shardd__gen_key(const char *buf_name, const char *view_name);
/* As shardd__gen_key, into buf (cap bytes) when the key fits there (a
 * malloc and free less per registration), else malloc'ed: the caller
 * frees the result unless it is buf. NULL when out of memory. */
char *shardd__gen_key_in(char *buf, size_t cap, const char *buf_name,
                         const char *view_name);
/* The last generation handed out under key in job; 0 for none. */
uint64_t shardd__gen_get(const shardd__job *job, const char *key);
/* Sets it (g 0 deletes); replacing an existing key cannot fail. */
shardd_err shardd__gen_put(shardd__job *job, const char *key, uint64_t g);
/* Hands out the next generation under key: *prev gets the last one (0 for
 * none) and the key holds *prev + 1 (gen_put(job, key, *prev) undoes it).
 * One lookup for what gen_get then gen_put did in two. */
shardd_err shardd__gen_next(shardd__job *job, const char *key, uint64_t *prev);
/* Records o (a buffer, or a view of the buffer buf_name) as freed in its
 * job's ring, before obj_fini frees its name; optimizers and frees during
 * job_release are not recorded. Copies what it keeps. */
void shardd__record_freed(shardd__obj *o, const char *buf_name);

/* The values of m, a map of objects, in id order; *out caller-freed with
 * free(), its entries borrowed from m. */
shardd_err shardd__obj_values(const shardd__map *m, void ***out, size_t *n);

/* Whether job may take more bytes under --job-memory-limit and its owner
 * under --uid-memory-limit; else err naming the flag. What a job holds
 * counts the pool bytes its registered units reserve (see
 * shardd__areas_reserve). */
int shardd__within_quota(const shardd__registry *reg, shardd__job *job,
                         uint64_t more, char *err, size_t errlen);
/* Whether job may take need more rank blocks (see max_blocks); else err. */
int shardd__within_blocks(shardd__registry *reg, shardd__job *job,
                          uint64_t need, char *err, size_t errlen);
/* A region job keeps beside its rank blocks (a pool, a seed, optimizer
 * state, a staging area): one holding a descriptor (a memfd) is one more
 * descriptor of the daemon, so it counts with the rank blocks. check: the
 * bounds apply (0: counted, never refused). 0 when refused: err says why,
 * ending "(WHAT would be one more)", and r is the caller's to free. */
int shardd__region_count(shardd__registry *reg, shardd__job *job,
                         const shardd__region *r, int check, const char *what,
                         char *err, size_t errlen);
/* Such a region's count given back as it is freed. */
void shardd__region_uncount(shardd__registry *reg, shardd__job *job,
                            const shardd__region *r);
/* An optimizer shard's state region freed (optimizer.c, seed.c): its
 * bytes and, when it holds a descriptor, its count with the rank blocks
 * (see shardd__optim_create) given back; sh->state is NULL after. */
void shardd__optim_state_free(shardd__registry *reg, shardd__optim_shard *sh);
/* Whether job may take one more view (see max_views); else err. */
int shardd__within_views(shardd__registry *reg, shardd__job *job, char *err,
                         size_t errlen);

/* ---- buffer.c, views.c, held.c, seed.c -------------------------------- */

/* The largest view rank, and the most elements of a buffer or a view. */
#define SHARDD__MAX_NDIM 16
#define SHARDD__MAX_NUMEL ((uint64_t)1 << 40)

/* Where a streamed area of bytes starting at start ends and the next may
 * begin (buffer blocks and optimizer state share this layout rule). */
size_t shardd__area_end(size_t start, size_t bytes);
/* Frees b with its views and blocks and unlists it from its job. The
 * caller has made sure no optimizer references it. */
void shardd__buffer_destroy(shardd__registry *reg, shardd__buffer *b);

/* Frees v and unlists it from its job's counts (views.c); its buffer's map
 * and indexes are the caller's to update. */
void shardd__view_destroy(shardd__registry *reg, shardd__view *v);

/* The treap priority of an object id (held.c; the kind index in views.c
 * uses it too): splitmix64's finaliser. */
uint64_t shardd__held_hash(uint64_t x);

/* Lists v (its owner just set) in, or takes it out of (its owner about to
 * be cleared), its buffer's index of held views. Cannot fail: the links are
 * v's own. */
void shardd__buffer_held_add(shardd__view *v);
void shardd__buffer_held_del(shardd__view *v);

/* ---- optimizer.c ------------------------------------------------------ */

/* Frees o and its state regions, unlists it, and drops its claims on the
 * buffers and views it referenced. Ignores holds: the caller checked. */
void shardd__optim_destroy(shardd__registry *reg, shardd__optim *o);

/* areas.c: a transient buffer's lease table (every slot free), and its
 * end (every lease returned); a job's pools, at its release. */
shardd_err shardd__areas_buffer_init(shardd__buffer *b);
void shardd__areas_buffer_fini(shardd__buffer *b);
void shardd__areas_free(shardd__registry *reg, shardd__job *job);

/* bytes zeros at off of r, directly where the daemon maps r (host), else
 * through the backend's write (cuda). */
shardd_err shardd__region_zero(shardd__backend *be, shardd__region *r,
                               size_t off, size_t bytes);

#endif /* SHARDD_REGISTRY_INT_H */
