/* restore.c — restores a job from a checkpoint directory (see
 * checkpoint.h), in four phases: read, on any thread, opens the directory,
 * reads the manifest whole (bounded by its size), checks its seal, splits
 * its lines and checks its job line against who asks, touching no
 * registry struct; apply, on the loop thread, replays the lines into a new
 * job (buffers, views, then each optimizer through the registration use
 * case) and lists every payload load; run, on any thread, loads and checks
 * the payloads, touching only the new job's region memory and the files;
 * finish, on the loop thread again, sets what the loads vouched for
 * (master_valid, step counts) and hands the job over. Any failure releases
 * the new job. The loads apply plans, and the optimizers registered again,
 * are restore_plan.c's; the manifest's lines are parsed by manifest.c. */
#include "checkpoint.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckfile.h"
#include "manifest.h"
#include "restore_int.h"

/* Fails the current line: "PATH line N: WHY" in err, WHY cut at 511 bytes.
 * Returns rc where a call beneath already failed with it, else
 * SHARDD_E_INVAL (the line itself is wrong). */
static shardd_err bad(restore *c, shardd_err rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static shardd_err bad(restore *c, shardd_err rc, const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(c->err, c->errlen, "%s line %d: %s", c->path, c->lineno, why);
  return rc == SHARDD_OK ? SHARDD_E_INVAL : rc;
}

/* Opens the checkpoint directory (no symlink on the way; for a client, one
 * it or the daemon owns) and the manifest in it. On failure nothing stays
 * open and err says why; the code follows errno as the callers expect. */
static shardd_err open_manifest(restore *c) {
  snprintf(c->path, sizeof c->path, "%s/%s", c->dir, SHARDD__MANIFEST_FILE);
  c->dd = (shardd__ckdir){-1, c->dir, c->as_uid};
  c->dd.fd = shardd__ck_open_dir(c->dir, c->err, c->errlen);
  if (c->dd.fd < 0)
    return errno == ELOOP || errno == ENOTDIR ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  struct stat dst;
  if (c->as_uid > 0 &&
      (fstat(c->dd.fd, &dst) != 0 ||
       (dst.st_uid != (uid_t)c->as_uid && dst.st_uid != geteuid()))) {
    snprintf(c->err, c->errlen, "%s: the directory is neither yours nor the "
             "daemon's; restore from a directory you own", c->dir);
    close(c->dd.fd);
    return SHARDD_E_PERMISSION;
  }
  int mfd = shardd__ck_open_regular(&c->dd, SHARDD__MANIFEST_FILE, c->err,
                                    c->errlen);
  /* bounded before a byte is read: restore holds the text and what its
   * lines plan (manifest.h) */
  struct stat mst;
  if (mfd >= 0 && fstat(mfd, &mst) == 0 &&
      (uint64_t)mst.st_size > SHARDD__MANIFEST_MAX) {
    snprintf(c->err, c->errlen, "%s: %jd bytes, more than the %zu MiB a "
             "manifest may have (shardd writes none larger); refused unread",
             c->path, (intmax_t)mst.st_size, SHARDD__MANIFEST_MAX >> 20);
    close(mfd);
    close(c->dd.fd);
    return SHARDD_E_LIMIT;
  }
  c->f = mfd >= 0 ? fdopen(mfd, "r") : NULL;
  if (c->f == NULL) {
    int e = errno;
    if (mfd >= 0) {
      snprintf(c->err, c->errlen, "%s: %s", c->path, strerror(e));
      close(mfd);
    } else if (e == ENOENT) {
      snprintf(c->err, c->errlen,
               "%s: %s (an incomplete checkpoint has no manifest; a "
               "multi-node job's checkpoint not taken collectively -- "
               "--checkpoint-on-exit -- has only node parts, node-N, and no "
               "job manifest to vouch for them: only a daemon with the job's "
               "--job-spec restores its node's part, to rejoin the live job)",
               c->path, strerror(e));
    }
    close(c->dd.fd);
    return e == EPERM || e == ELOOP ? SHARDD_E_PERMISSION : SHARDD_E_IO;
  }
  return SHARDD_OK;
}

/* A line the reader refused (too long, a NUL, no memory, a read error). */
static shardd_err line_error(restore *c, shardd__line_rc lr) {
  return shardd__manifest_line_error(lr, c->path, c->lineno, c->err, c->errlen);
}

static shardd_err line_header(restore *c, char **tok, int nt) {
  char why[512];
  if (shardd__manifest_header(tok, nt, &c->mversion, why, sizeof why) !=
      SHARDD_OK)
    return bad(c, SHARDD_E_INVAL, "%s", why);
  return SHARDD_OK;
}

/* Whether the files that record owner as a job's owner may say so: the
 * directory (dirfd) and the manifest (filefd) must be owner's or the
 * daemon's. The owner line is only text; without this, root restoring a
 * directory another user wrote (an operator's --restore or Restore)
 * created the victim's job, the victim's own spec and quotas applying,
 * with the writer's weights. */
static shardd_err vouched(int dirfd, int filefd, uint32_t owner,
                          const char *path, const char *job, char *err,
                          size_t errlen) {
  struct stat ds, fs;
  if (fstat(dirfd, &ds) != 0 || fstat(filefd, &fs) != 0) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return SHARDD_E_IO;
  }
  uid_t me = geteuid();
  uid_t bad = ds.st_uid != owner && ds.st_uid != me   ? ds.st_uid
              : fs.st_uid != owner && fs.st_uid != me ? fs.st_uid
                                                      : (uid_t)-1;
  if (bad == (uid_t)-1)
    return SHARDD_OK;
  snprintf(err, errlen, "%s records job \"%s\" as uid %" PRIu32 "'s, but %s "
           "belongs to uid %u: only the job's owner or the daemon writes its "
           "checkpoints; refused", path, job, owner,
           ds.st_uid == bad ? "its directory" : "the file", (unsigned)bad);
  return SHARDD_E_PERMISSION;
}

/* The job line (its name decoded) against who asks and what the caller
 * wants, from the files alone (no registry struct: on the reading thread):
 * another job's part (SHARDD_E_NOT_FOUND), another owner's. */
static shardd_err job_check(restore *c, const shardd__mline *ml) {
  const char *name = ml->u.job.name;
  if (c->exit_name && strcmp(name, c->exit_name)) {
    /* another spec's job may have its part here: the caller looks on */
    snprintf(c->err, c->errlen, "%s: a part of job \"%s\", not \"%s\"",
             c->path, name, c->exit_name);
    return SHARDD_E_NOT_FOUND;
  }
  if (c->exit_name && ml->u.job.world != c->exit_world)
    return bad(c, SHARDD_E_MISMATCH, "job \"%s\" of world %s, but its job "
               "spec here says world %" PRIu32, name, ml->u.job.world_word,
               c->exit_world);
  uint32_t owner = ml->u.job.owner;
  if (c->as_uid > 0 && (uint32_t)c->as_uid != owner) {
    snprintf(c->err, c->errlen, "job \"%s\" in %s belongs to another user; "
             "only it or root may restore it", name, c->dir);
    return SHARDD_E_PERMISSION;
  }
  /* a job spec that names a uid lays out (and joins over the fabric) that
   * uid's job only: another uid's part of that name never gets it */
  if (c->want_uid >= 0 && owner != (uint64_t)c->want_uid) {
    if (c->spec_path)
      snprintf(c->err, c->errlen, "%s: a part of uid %" PRIu32 "'s job \"%s\", "
               "but its job spec %s is for uid %" PRId64 "'s job of that name "
               "only; refused", c->path, owner, name, c->spec_path,
               c->want_uid);
    else
      snprintf(c->err, c->errlen, "%s: a part of uid %" PRIu32 "'s job \"%s\", "
               "but the job manifest above it is uid %" PRId64 "'s; refused",
               c->path, owner, name, c->want_uid);
    return SHARDD_E_PERMISSION;
  }
  shardd_err rc = vouched(c->dd.fd, fileno(c->f), owner, c->path, name,
                          c->err, c->errlen);
  if (rc != SHARDD_OK)
    return rc;
  /* the data files likewise: the owner's or the daemon's, one link each */
  if (c->as_uid <= 0 && owner > 0)
    c->dd.as_uid = owner;
  c->job_checked = 1;
  return SHARDD_OK;
}

/* "job NAME WORLD OWNER": creates the new job. A job of that name that is
 * live already is refused, never touched. */
static shardd_err line_job(restore *c, const shardd__mline *ml) {
  if (!ml->u.job.name_ok)
    return bad(c, SHARDD_E_INVAL, "bad job name");
  shardd_err rc;
  if (!c->job_checked && (rc = job_check(c, ml)) != SHARDD_OK)
    return rc;
  const char *name = ml->u.job.name;
  uint32_t owner = ml->u.job.owner;
  if (shardd__job_find(c->reg, owner, name)) {
    snprintf(c->err, c->errlen,
             "job \"%s\" of uid %" PRIu32 " exists already; release it "
             "before restoring (shardctl release, once its ranks left)",
             name, owner);
    return SHARDD_E_BUSY;
  }
  /* every buffer line keeps a bit per old rank: a world past any job's
   * cost 512 MiB a line */
  unsigned long ow = ml->u.job.world;
  if (ow == 0 || ow > SHARDD__WORLD_MAX)
    return bad(c, SHARDD_E_INVAL, "world %s is out of range [1, %u]",
               ml->u.job.world_word, SHARDD__WORLD_MAX);
  c->old_world = (uint32_t)ow;
  rc = shardd__job_get(c->reg, name, c->world ? c->world : c->old_world,
                       owner, &c->job, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  /* a node's part: laid out before any buffer, as a Hello under the job's
   * spec would have; the origin is compared by every exchange */
  if (c->nodes > 1) {
    rc = shardd__job_set_layout(c->job, c->nodes, c->node_rank, c->sub,
                                sizeof c->sub);
    if (rc != SHARDD_OK)
      return bad(c, rc, "%s", c->sub);
    c->job->origin = c->origin;
  }
  return SHARDD_OK;
}

/* "node N NODES": the manifest is node N's part of a checkpoint over NODES
 * nodes; it must be the part this restore asked for. */
static shardd_err line_node(restore *c, const shardd__mline *ml) {
  uint32_t n = ml->u.node.node, nodes = ml->u.node.nodes;
  if (c->nodes <= 1)
    return bad(c, SHARDD_E_INVAL,
               "this is node %" PRIu32 "'s part of a checkpoint over %" PRIu32
               " nodes: restore the job checkpoint above it (its directory "
               "holds the job manifest), on every node",
               n, nodes);
  if (n != c->node_rank || nodes != c->nodes || c->node_seen)
    return bad(c, SHARDD_E_MISMATCH,
               "part of node %" PRIu32 " of %" PRIu32 " where node %" PRIu32
               " of %" PRIu32 "'s was expected (parts swapped?)",
               n, nodes, c->node_rank, c->nodes);
  c->node_seen = 1;
  return SHARDD_OK;
}

/* "buffer NAME DTYPE NUMEL [GEN]": registers it, zeroed until its shards. */
static shardd_err line_buffer(restore *c, const shardd__mline *ml) {
  shardd__buffer *b;
  int created;
  if (!ml->u.buffer.name_ok)
    return bad(c, SHARDD_E_INVAL, "bad buffer name");
  shardd_err rc = shardd__buffer_register(
      c->reg, c->job, ml->u.buffer.name, (shardd_dtype)ml->u.buffer.dtype,
      ml->u.buffer.numel, &b, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  if (!created)
    return bad(c, SHARDD_E_INVAL, "buffer \"%s\" listed twice",
               ml->u.buffer.name);
  b->settled = 1; /* trainers attach to the restored values */
  /* A restored handle is a new generation: one kept from before the
   * checkpoint is refused as stale. */
  shardd__obj_set_generation(&b->hdr, ml->u.buffer.generation + 1);
  shardd__buffer **nbufs = realloc(c->bufs, (c->nb + 1) * sizeof *c->bufs);
  if (nbufs == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->bufs = nbufs;
  uint8_t **nseen = realloc(c->seen, (c->nb + 1) * sizeof *c->seen);
  if (nseen == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->seen = nseen;
  if ((c->seen[c->nb] = calloc((c->old_world + 7) / 8, 1)) == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  char **nnames = realloc(c->bnames, (c->nb + 1) * sizeof *c->bnames);
  if (nnames == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->bnames = nnames;
  if ((c->bnames[c->nb] = strdup(b->hdr.name)) == NULL) {
    free(c->seen[c->nb]);
    return bad(c, SHARDD_E_INVAL, "out of memory");
  }
  c->bufs[c->nb++] = b;
  return SHARDD_OK;
}

/* "shard BUF RANK FILE CRC": plans the payload's load into the buffer the
 * lines above registered (run loads it). */
static shardd_err line_shard(restore *c, const shardd__mline *ml) {
  size_t bi = ml->u.shard.buf;
  uint32_t r = ml->u.shard.rank;
  if (bi >= c->nb || r >= c->old_world || !ml->u.shard.file_ok)
    return bad(c, SHARDD_E_INVAL, "shard of unknown buffer %zu rank %" PRIu32,
               bi, r);
  if (c->nodes > 1 && !shardd__job_rank_local(c->job, r))
    return bad(c, SHARDD_E_MISMATCH,
               "shard of rank %" PRIu32 ", which is not node %" PRIu32 "'s",
               r, c->node_rank);
  if (c->seen[bi][r / 8] & (1u << (r % 8)))
    return bad(c, SHARDD_E_INVAL,
               "shard of buffer %zu rank %" PRIu32 " listed twice", bi, r);
  c->seen[bi][r / 8] |= (uint8_t)(1u << (r % 8));
  c->nshard_lines++;
  return shardd__restore_plan_shard(c, ml->u.shard.file, ml->u.shard.crc, bi,
                                    r);
}

/* "view BUF NAME OFFSET NUMEL NDIM DIM... GEN REQUIRES_GRAD". */
static shardd_err line_view(restore *c, const shardd__mline *ml) {
  size_t bi = ml->u.view.buf;
  if (bi >= c->nb || !ml->u.view.ok)
    return bad(c, SHARDD_E_INVAL, "malformed view");
  shardd__view *v;
  int created;
  shardd_err rc = shardd__view_register_ex(
      c->reg, c->job, c->bufs[bi]->hdr.id, 0, ml->u.view.name,
      ml->u.view.offset, ml->u.view.numel, ml->u.view.shape, ml->u.view.ndim,
      ml->u.view.requires_grad, &v, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return bad(c, rc, "%s", c->sub);
  if (!created)
    return bad(c, SHARDD_E_INVAL, "view \"%s\" listed twice",
               ml->u.view.name);
  c->nviews++;
  shardd__obj_set_generation(&v->hdr, ml->u.view.generation + 1);
  return SHARDD_OK;
}

/* "optimizer INDEX NAME STEPS SPEC_HEX": pending until every ref and state
 * line is read; registered after the last line. */
static shardd_err line_optimizer(restore *c, const shardd__mline *ml) {
  if (ml->u.optimizer.index != c->npo || !ml->u.optimizer.name_ok)
    return bad(c, SHARDD_E_INVAL, "optimizers out of order");
  /* each optimizer owns buffers or views of its own, registered above */
  if (c->npo >= c->nb + c->nviews)
    return bad(c, SHARDD_E_INVAL, "optimizer %zu, but the lines above "
               "registered %zu buffers and views for optimizers to own",
               c->npo, c->nb + c->nviews);
  size_t hl = strlen(ml->u.optimizer.spec_hex);
  if (hl / 2 > SPECS_MAX - c->spec_bytes)
    return bad(c, SHARDD_E_INVAL, "optimizer registrations of %zu bytes "
               "together, more than the %zu a manifest may hold", c->spec_bytes
               + hl / 2, SPECS_MAX);
  c->spec_bytes += hl / 2;
  pending_optim *np = realloc(c->po, (c->npo + 1) * sizeof *c->po);
  if (np == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  c->po = np;
  pending_optim *p = &c->po[c->npo++];
  memset(p, 0, sizeof *p);
  p->name = strdup(ml->u.optimizer.name);
  p->steps = ml->u.optimizer.steps;
  p->spec = malloc(hl / 2 + 1);
  if (p->name == NULL || p->spec == NULL ||
      !shardd__manifest_unhex(ml->u.optimizer.spec_hex, p->spec))
    return bad(c, SHARDD_E_INVAL, "bad optimizer spec");
  p->spec_len = hl / 2;
  return SHARDD_OK;
}

/* "ref OPT OLD_ID buffer BUF [STEPS]" or "ref OPT OLD_ID view BUF NAME
 * [STEPS]" (STEPS from version 4): maps an id in the optimizer's recorded
 * spec to the restored object, and gives that ref its step count. */
static shardd_err line_ref(restore *c, const shardd__mline *ml) {
  size_t oi = ml->u.ref.opt;
  size_t bi = ml->u.ref.buf;
  if (oi >= c->npo || bi >= c->nb)
    return bad(c, SHARDD_E_INVAL, "ref to unknown optimizer or buffer");
  shardd__obj *o = &c->bufs[bi]->hdr;
  if (ml->u.ref.is_view) {
    if (!ml->u.ref.ok ||
        (o = shardd__map_get_str(&c->bufs[bi]->views, ml->u.ref.view)) ==
            NULL)
      return bad(c, SHARDD_E_INVAL, "ref to unknown view");
  } else if (!ml->u.ref.ok) {
    return bad(c, SHARDD_E_INVAL, "malformed ref");
  }
  /* an object is owned by one optimizer: one ref line, so their count is
   * bounded by what the lines above registered */
  if (shardd__map_get_id(&c->reffed, o->id))
    return bad(c, SHARDD_E_INVAL, "a second ref line to buffer %zu's %s",
               bi, o->name);
  if (shardd__map_put_id(&c->reffed, o->id, o) != SHARDD_OK)
    return bad(c, SHARDD_E_NO_MEMORY, "out of memory");
  pending_optim *p = &c->po[oi];
  if (shardd__map_put_id(&p->bufs_reffed, (uint64_t)bi + 1, p) != SHARDD_OK)
    return bad(c, SHARDD_E_NO_MEMORY, "out of memory");
  id_map *ni = realloc(p->ids, (p->nids + 1) * sizeof *ni);
  if (ni == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  p->ids = ni;
  /* before version 4 every step stepped every ref */
  uint64_t steps = ml->u.ref.has_steps ? ml->u.ref.steps : p->steps;
  p->ids[p->nids++] = (id_map){ml->u.ref.old_id, o, steps};
  return SHARDD_OK;
}

/* "state OPT BUF RANK MASTER_VALID FILE CRC BYTES NSTATE": a payload
 * planned once its optimizer is registered. */
static shardd_err line_state(restore *c, const shardd__mline *ml) {
  size_t oi = ml->u.state.opt;
  size_t bi = ml->u.state.buf;
  if (oi >= c->npo || bi >= c->nb || !ml->u.state.file_ok)
    return bad(c, SHARDD_E_INVAL, "state of unknown optimizer or buffer");
  pending_optim *p = &c->po[oi];
  unsigned long rank = ml->u.state.rank;
  int nstate = ml->u.state.nstate;
  if (rank >= c->old_world || nstate < 0 || nstate > 3)
    return bad(c, SHARDD_E_INVAL, "state of rank %s of a world of %" PRIu32
               ", or a bad state count", ml->u.state.rank_word,
               c->old_world);
  /* shardd writes an optimizer's ref lines before its state lines: each
   * state is of a buffer it owns, so their count is bounded by the refs */
  if (!shardd__map_get_id(&p->bufs_reffed, (uint64_t)bi + 1))
    return bad(c, SHARDD_E_INVAL, "state of buffer %zu, which no ref line of "
               "optimizer %zu above names", bi, oi);
  uint64_t key = (uint64_t)bi << 17 | rank;
  if (shardd__map_get_id(&p->state_seen, key))
    return bad(c, SHARDD_E_INVAL, "state of buffer %zu rank %lu listed twice",
               bi, rank);
  if (shardd__map_put_id(&p->state_seen, key, p) != SHARDD_OK)
    return bad(c, SHARDD_E_NO_MEMORY, "out of memory");
  /* The file is read into memory of its stated size: the size must be the
   * state this rank's shard of the buffer keeps (its arrays' layout, plus
   * at most a backend's rounding), checked before anything is allocated.
   * A sparse file claiming 3 GiB for a buffer of 8 elements was read whole
   * and the daemon was OOM-killed. */
  shardd__buffer *b = c->bufs[bi];
  uint64_t lo, hi, old_s;
  shardd__restore_old_range(b, c->old_world, (uint32_t)rank, &lo, &hi, &old_s);
  size_t omaster, ooffs[3];
  size_t used = shardd__optim_state_layout(b->dtype, old_s, nstate, &omaster,
                                           ooffs);
  unsigned long long bytes = ml->u.state.bytes;
  if (!ml->u.state.bytes_ok || bytes < used ||
      bytes - used >= SHARDD__REGION_GRAIN_MAX || bytes % 4)
    return bad(c, SHARDD_E_INVAL, "%s/%s states %s bytes, but buffer \"%s\" "
               "rank %lu of a world of %" PRIu32 " holds %zu bytes of state in "
               "%d arrays (%zu with a backend's rounding, at most); refused "
               "unread", c->dd.path, ml->u.state.file, ml->u.state.bytes_word,
               b->hdr.name, rank,
               c->old_world, used, nstate,
               used + SHARDD__REGION_GRAIN_MAX - 1);
  pending_state *ns = realloc(p->states, (p->nstates + 1) * sizeof *ns);
  if (ns == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  p->states = ns;
  pending_state *ps = &p->states[p->nstates++];
  memset(ps, 0, sizeof *ps);
  ps->buf = bi;
  ps->rank = (uint32_t)rank;
  ps->master_valid = ml->u.state.master_valid;
  ps->crc = ml->u.state.crc;
  ps->bytes = (size_t)bytes;
  ps->nstate = nstate;
  if ((ps->file = strdup(ml->u.state.file)) == NULL)
    return bad(c, SHARDD_E_INVAL, "out of memory");
  return SHARDD_OK;
}

/* One manifest line, split into words and parsed (manifest.c): the header
 * first, then nothing but the job line until it came, nothing at all after
 * "end". */
static shardd_err apply_line(restore *c, char **tok, int nt) {
  if (c->lineno == 1)
    return line_header(c, tok, nt);
  if (c->ended)
    return bad(c, SHARDD_E_INVAL, "text after \"end\"");
  shardd__mline ml;
  shardd__manifest_parse(tok, nt, c->mversion, &ml);
  if (ml.kind == SHARDD__ML_END) {
    if (nt != 2)
      return bad(c, SHARDD_E_INVAL, "malformed \"end\" line");
    /* the seal was checked on the line that starts "end ": one that only
     * splits into "end" (a leading space) ended the manifest unchecked */
    if (c->lineno != c->seal_line)
      return bad(c, SHARDD_E_INVAL, "an \"end\" line whose checksum was not "
                 "checked (not a manifest shardd wrote)");
    c->ended = 1;
    return SHARDD_OK;
  }
  if (ml.kind == SHARDD__ML_JOB && c->job == NULL)
    return line_job(c, &ml);
  if (c->job == NULL)
    return bad(c, SHARDD_E_INVAL, "\"%s\" before the job line", tok[0]);
  if (ml.kind == SHARDD__ML_NODE)
    return line_node(c, &ml);
  if (c->nodes > 1 && !c->node_seen)
    return bad(c, SHARDD_E_INVAL, "no \"node\" line after the job line (not "
               "a node's part of a multi-node checkpoint)");
  if (ml.kind == SHARDD__ML_LINEAGE && c->nodes > 1) {
    /* a collective part's lineage is not kept: its restore forms a new
     * fabric on every node; an exit part rejoins the live one */
    if (c->exit_name) {
      c->job->lineage = ml.u.lineage.lineage;
      c->job->origin = ml.u.lineage.origin;
      c->job->rejoining = 1;
      c->lineage_seen = 1;
    }
    return SHARDD_OK;
  }
  if (ml.kind == SHARDD__ML_TRANSIENT) {
    /* before any buffer line (set_transient refuses a job with buffers) */
    shardd_err rc = shardd__job_set_transient(c->job, 1, c->sub, sizeof c->sub);
    return rc == SHARDD_OK ? SHARDD_OK : bad(c, rc, "%s", c->sub);
  }
  switch (ml.kind) {
  case SHARDD__ML_BUFFER:
    return line_buffer(c, &ml);
  case SHARDD__ML_SHARD:
    return line_shard(c, &ml);
  case SHARDD__ML_VIEW:
    return line_view(c, &ml);
  case SHARDD__ML_OPTIMIZER:
    return line_optimizer(c, &ml);
  case SHARDD__ML_REF:
    return line_ref(c, &ml);
  case SHARDD__ML_STATE:
    return line_state(c, &ml);
  default:
    return bad(c, SHARDD_E_INVAL, "unknown or malformed line \"%s\"", tok[0]);
  }
}

/* Reads the manifest whole into c->text (its size was bounded when it was
 * opened), ends each line with a NUL where its newline was, and checks the
 * seal (the CRC32C on its "end" line, of every byte before it) as
 * shardd__manifest_verify_seal does: a mismatch refuses the manifest
 * before any line is acted upon. A line the line reader would refuse (too
 * long, a NUL byte) stops the split: apply reports it when it gets there,
 * after the lines above it, as a reader line by line would. Touches no
 * registry struct (any thread). */
static shardd_err read_text(restore *c) {
  struct stat st;
  if (fstat(fileno(c->f), &st) != 0) {
    snprintf(c->err, c->errlen, "%s: %s", c->path, strerror(errno));
    return SHARDD_E_IO;
  }
  size_t want = (size_t)st.st_size; /* <= SHARDD__MANIFEST_MAX (open) */
  if ((c->text = malloc(want + 2)) == NULL) {
    snprintf(c->err, c->errlen, "%s: out of memory reading %zu bytes", c->path,
             want);
    return SHARDD_E_NO_MEMORY;
  }
  /* one byte more than its size: a file grown since is not read past */
  size_t n = fread(c->text, 1, want + 1, c->f);
  if (ferror(c->f) || n > want) {
    snprintf(c->err, c->errlen, "%s: %s", c->path,
             ferror(c->f) ? strerror(errno) : "changed while being read");
    return SHARDD_E_IO;
  }
  c->text[n] = '\0';
  c->text_len = n;
  return shardd__manifest_split_text(c->text, n, c->path, &c->stop_line,
                                     &c->stop_rc, &c->seal_line, c->err,
                                     c->errlen);
}

/* Calls fn on each line of the text with words, in order, up to the first
 * the reader refused (its error then); blank lines are skipped. fn's
 * first failure ends it. The words are split in place. */
static shardd_err each_line(restore *c,
                            shardd_err (*fn)(restore *c, char **tok, int nt)) {
  size_t pos = 0;
  for (c->lineno = 1; pos < c->text_len; c->lineno++) {
    if (c->lineno == c->stop_line)
      return line_error(c, c->stop_rc);
    char *line = c->text + pos;
    pos += strlen(line) + 1;
    char *tok[SHARDD__MANIFEST_MAX_TOK];
    int nt = shardd__manifest_split_words(line, tok);
    if (nt == 0)
      continue;
    shardd_err rc = fn(c, tok, nt);
    if (rc != SHARDD_OK)
      return rc;
  }
  return SHARDD_OK; /* a refused line holds a byte: the loop met it */
}

/* Checks the header and the job line against who asks and what the caller
 * wants, from the text alone, before any registry struct is touched
 * (jobs.c tries each candidate part off the loop: another job's part is
 * SHARDD_E_NOT_FOUND). Whatever else is wrong there apply reports, as it
 * would have. Splits copies of the lines: apply splits the text itself. */
static shardd_err precheck(restore *c) {
  size_t pos = 0;
  shardd_err rc = SHARDD_OK;
  for (c->lineno = 1; pos < c->text_len && c->lineno != c->stop_line;
       c->lineno++) {
    const char *line = c->text + pos;
    size_t len = strlen(line);
    pos += len + 1;
    char *copy = malloc(len + 1), *tok[SHARDD__MANIFEST_MAX_TOK];
    if (copy == NULL) {
      snprintf(c->err, c->errlen, "out of memory");
      rc = SHARDD_E_NO_MEMORY;
      break;
    }
    memcpy(copy, line, len + 1);
    int nt = shardd__manifest_split_words(copy, tok);
    if (nt > 0 && c->lineno == 1) {
      rc = line_header(c, tok, nt);
      free(copy);
      if (rc != SHARDD_OK)
        break;
      continue;
    }
    if (nt > 0) {
      shardd__mline ml;
      shardd__manifest_parse(tok, nt, 0, &ml);
      if (ml.kind == SHARDD__ML_JOB && ml.u.job.name_ok)
        rc = job_check(c, &ml);
    }
    free(copy);
    if (nt > 0)
      break; /* only the first line after the header may be the job's */
  }
  c->lineno = 0;
  c->mversion = 0;
  return rc;
}

/* Replays the lines: the job, buffers and views are registered and each
 * shard's load planned as its line comes; optimizers are only collected. */
static shardd_err parse_manifest(restore *c) {
  return each_line(c, apply_line);
}

/* What a whole manifest must have: an "end" line, a job line, and a shard
 * line for every rank of every buffer. */
static shardd_err check_complete(restore *c) {
  if (!c->ended) {
    snprintf(c->err, c->errlen, "%s: no \"end\" line (truncated manifest)",
             c->path);
    return SHARDD_E_INVAL;
  }
  if (c->job == NULL) {
    /* "shardd-checkpoint 2" + "end" restored nothing and returned OK: the
     * callers took the NULL job and the daemon died with every shard. */
    snprintf(c->err, c->errlen,
             "%s: no \"job\" line (not a checkpoint shardd wrote)", c->path);
    return SHARDD_E_INVAL;
  }
  if (c->nb > 0 && c->nshard_lines == 0) {
    snprintf(c->err, c->errlen, "%s: names %zu buffer%s but no shard of any "
             "(a corrupt or truncated manifest)", c->path, c->nb,
             c->nb == 1 ? "" : "s");
    return SHARDD_E_INVAL;
  }
  if (c->nodes > 1 && !c->node_seen) {
    snprintf(c->err, c->errlen, "%s: no \"node\" line (not a node's part "
             "of a multi-node checkpoint)", c->path);
    return SHARDD_E_INVAL;
  }
  if (c->exit_name && !c->lineage_seen) {
    snprintf(c->err, c->errlen, "%s: no \"lineage\" line (written by a "
             "shardd that could not rejoin a live job with it): restore a "
             "collective checkpoint on every node", c->path);
    return SHARDD_E_INVAL;
  }
  /* a node's part holds its own ranks' shards only */
  uint32_t lo = c->nodes > 1 ? c->job->local_first : 0,
           hi = c->nodes > 1 ? lo + c->job->local_ranks : c->old_world;
  for (size_t i = 0; i < c->nb; i++)
    for (uint32_t r = lo; r < hi; r++)
      if (!(c->seen[i][r / 8] & (1u << (r % 8)))) {
        snprintf(c->err, c->errlen, "%s: no shard of buffer \"%s\" rank %" PRIu32
                 " (a corrupt or truncated manifest)", c->path,
                 c->bufs[i]->hdr.name, r);
        return SHARDD_E_INVAL;
      }
  return SHARDD_OK;
}

/* Registers each collected optimizer, in manifest order, and plans the
 * loads of its state files. */
static shardd_err restore_optimizers(restore *c) {
  for (size_t i = 0; i < c->npo; i++) {
    shardd_err rc = shardd__restore_register_pending(c->reg, c->job, &c->po[i],
                                                     c->err, c->errlen);
    if (rc == SHARDD_OK)
      rc = shardd__restore_plan_states(c, &c->po[i]);
    if (rc != SHARDD_OK)
      return rc;
  }
  return SHARDD_OK;
}

void shardd__checkpoint_restore_free(shardd__ckrestore *c) {
  if (c == NULL)
    return;
  if (c->job) /* not handed over: the restore failed */
    shardd__job_release(c->reg, c->job);
  for (size_t i = 0; i < c->npo; i++) {
    free(c->po[i].name);
    free(c->po[i].spec);
    free(c->po[i].ids);
    free(c->po[i].mv);
    free(c->po[i].ref_steps);
    for (size_t k = 0; k < c->po[i].nstates; k++)
      free(c->po[i].states[k].file);
    free(c->po[i].states);
    shardd__map_free(&c->po[i].state_seen);
    shardd__map_free(&c->po[i].bufs_reffed);
  }
  free(c->po);
  shardd__map_free(&c->reffed);
  for (size_t i = 0; i < c->nloads; i++) {
    free(c->loads[i].file);
    free(c->loads[i].copies);
  }
  free(c->loads);
  for (size_t i = 0; i < c->nb; i++) {
    free(c->seen[i]);
    free(c->bnames[i]);
  }
  free(c->seen);
  free(c->bnames);
  free(c->bufs);
  for (size_t i = 0; i < c->nshadows; i++)
    free(c->shadows[i].host);
  free(c->shadows);
  free(c->text);
  if (c->f)
    fclose(c->f);
  if (c->dd.fd >= 0)
    close(c->dd.fd);
  free(c->dir);
  free(c);
}

static shardd_err read_restore(shardd__registry *reg, const char *dir,
                          int64_t as_uid, uint32_t world, uint32_t nodes,
                          uint32_t node_rank, uint64_t origin,
                          const char *exit_name, int64_t want_uid,
                          const char *spec_path, shardd__ckrestore **out,
                          char *err, size_t errlen) {
  *out = NULL;
  /* a request's path may be as long as its frame: messages and the
   * part names below are built in fixed buffers, and a cut one named
   * another directory */
  size_t longest = sizeof ((restore *)0)->path - sizeof "/" SHARDD__MANIFEST_FILE;
  if (strlen(dir) > longest) {
    snprintf(err, errlen, "%.256s...: path longer than %zu bytes", dir, longest);
    return SHARDD_E_INVAL;
  }
  restore *c = calloc(1, sizeof *c);
  if (c == NULL || (c->dir = strdup(dir)) == NULL) {
    free(c);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->reg = reg;
  c->as_uid = as_uid;
  c->world = world;
  c->nodes = nodes;
  c->node_rank = node_rank;
  c->origin = origin;
  c->exit_name = exit_name;
  c->exit_world = world;
  c->want_uid = want_uid;
  c->spec_path = spec_path;
  c->err = err;
  c->errlen = errlen;
  c->dd.fd = -1;
  shardd_err rc = open_manifest(c);
  if (rc != SHARDD_OK) {
    c->f = NULL; /* open_manifest closed what it opened */
    c->dd.fd = -1;
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  if ((rc = read_text(c)) == SHARDD_OK)
    rc = precheck(c);
  c->err = NULL; /* the caller's, during each phase only */
  c->errlen = 0;
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_restore_apply(shardd__ckrestore *c, char *err,
                                            size_t errlen) {
  c->err = err;
  c->errlen = errlen;
  shardd_err rc;
  if ((rc = parse_manifest(c)) == SHARDD_OK &&
      (rc = check_complete(c)) == SHARDD_OK)
    rc = restore_optimizers(c);
  c->err = NULL;
  c->errlen = 0;
  /* the manifest is applied: only the directory stays open, for run */
  free(c->text);
  c->text = NULL;
  if (c->f) /* none for a manifest given as text */
    fclose(c->f);
  c->f = NULL;
  return rc;
}

/* read, then apply: the loop-thread restore of before (tests, the fuzzer) */
static shardd_err prepare(shardd__ckrestore *c, shardd__ckrestore **out,
                          char *err, size_t errlen) {
  shardd_err rc = shardd__checkpoint_restore_apply(c, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_restore_read(shardd__registry *reg,
                                           const char *dir, int64_t as_uid,
                                           uint32_t world,
                                           shardd__ckrestore **out, char *err,
                                           size_t errlen) {
  return read_restore(reg, dir, as_uid, world, 0, 0, 0, NULL, -1, NULL, out,
                      err, errlen);
}

shardd_err shardd__checkpoint_restore_prepare(shardd__registry *reg,
                                              const char *dir, int64_t as_uid,
                                              uint32_t world,
                                              shardd__ckrestore **out,
                                              char *err, size_t errlen) {
  shardd__ckrestore *c;
  *out = NULL;
  shardd_err rc = shardd__checkpoint_restore_read(reg, dir, as_uid, world, &c,
                                                  err, errlen);
  return rc == SHARDD_OK ? prepare(c, out, err, errlen) : rc;
}

/* Opens dir/manifest as restore does (no symlink, the asker's or the
 * daemon's directory and file) and checks its seal into *seal. *f is the
 * caller's to fclose; so is *dirfd, the directory, where dirfd is not NULL
 * (else it is closed). */
static shardd_err open_sealed(const char *dir, int64_t as_uid, FILE **f,
                              int *dirfd, uint32_t *seal, int *end_line, char *err,
                              size_t errlen) {
  restore c = {0};
  c.dir = (char *)dir;
  c.as_uid = as_uid;
  c.err = err;
  c.errlen = errlen;
  shardd_err rc = open_manifest(&c);
  if (rc != SHARDD_OK)
    return rc;
  rc = shardd__manifest_verify_seal(c.f, c.path, seal, end_line, err, errlen);
  if (rc != SHARDD_OK || dirfd == NULL)
    close(c.dd.fd);
  if (rc != SHARDD_OK) {
    fclose(c.f);
    return rc;
  }
  if (dirfd)
    *dirfd = c.dd.fd;
  *f = c.f;
  return SHARDD_OK;
}

shardd_err shardd__checkpoint_read_job(const char *dir, int64_t as_uid,
                                       shardd__ckjob *out, char *err,
                                       size_t errlen) {
  memset(out, 0, sizeof *out);
  FILE *f;
  uint32_t seal;
  int dfd, end_line;
  shardd_err rc = open_sealed(dir, as_uid, &f, &dfd, &seal, &end_line, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  int lineno;
  int kind = shardd__manifest_read_job(f, end_line, out, &lineno);
  if (kind == 0) /* an ordinary checkpoint */
    goto done;
  if (kind < 0)
    goto malformed;
  if (as_uid > 0 && (uint32_t)as_uid != out->uid) {
    snprintf(err, errlen, "job \"%s\" in %s belongs to another user; only it "
             "or root may restore it", out->name, dir);
    rc = SHARDD_E_PERMISSION;
    goto done;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, SHARDD__MANIFEST_FILE);
  if ((rc = vouched(dfd, fileno(f), out->uid, path, out->name, err, errlen)) !=
      SHARDD_OK)
    goto done;
  out->seal = seal;
  goto done;
malformed:
  snprintf(err, errlen, "%s/%s line %d: not a job manifest shardd wrote "
           "(malformed or incomplete)", dir, SHARDD__MANIFEST_FILE, lineno);
  rc = SHARDD_E_INVAL;
done:
  fclose(f);
  close(dfd);
  return rc;
}

shardd_err shardd__checkpoint_restore_read_part(
    shardd__registry *reg, const char *dir, int64_t as_uid,
    const shardd__ckjob *job, uint32_t node_rank, shardd__ckrestore **out,
    char *err, size_t errlen) {
  *out = NULL;
  char part[4096];
  if (node_rank >= job->nodes) {
    snprintf(err, errlen, "%s: a checkpoint of job \"%s\" over %" PRIu32
             " nodes has no part for node %" PRIu32, dir, job->name, job->nodes,
             node_rank);
    return SHARDD_E_MISMATCH;
  }
  /* Every node's part, not only this one: a part missing or replaced by a
   * later checkpoint's is found here, on every node, before any of them
   * loads anything, and named. */
  for (uint32_t n = 0; n < job->nodes; n++) {
    if ((size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, n) >=
        sizeof part) {
      snprintf(err, errlen, "%.256s...: path too long", dir);
      return SHARDD_E_INVAL;
    }
    FILE *f;
    uint32_t seal;
    int end_line;
    char why[768];
    shardd_err rc = open_sealed(part, as_uid, &f, NULL, &seal, &end_line, why,
                                sizeof why);
    if (rc == SHARDD_OK)
      fclose(f);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "job checkpoint %s: node %" PRIu32 "'s part is "
               "missing or unreadable: %s", dir, n, why);
      return rc == SHARDD_E_PERMISSION ? rc : SHARDD_E_MISMATCH;
    }
    if (seal != job->seals[n]) {
      snprintf(err, errlen, "job checkpoint %s: node %" PRIu32 "'s part %s is "
               "sealed %08" PRIx32 ", the job manifest says %08" PRIx32 " (a "
               "part of another checkpoint, or one rewritten since)",
               dir, n, part, seal, job->seals[n]);
      return SHARDD_E_MISMATCH;
    }
  }
  snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, node_rank);
  /* origin: nonzero even where the CRC is 0, so "restored" stays apart
   * from "fresh" in the exchange header */
  return read_restore(reg, part, as_uid, 0, job->nodes, node_rank,
                      (uint64_t)job->seal | 1ull << 32, NULL, job->uid, NULL,
                      out, err, errlen);
}

shardd_err shardd__checkpoint_restore_read_exit_part(
    shardd__registry *reg, const char *dir, int64_t as_uid, const char *name,
    uint32_t world, uint32_t nodes, uint32_t node_rank, int64_t spec_uid,
    const char *spec_path, shardd__ckrestore **out, char *err, size_t errlen) {
  *out = NULL;
  char part[4096];
  if ((size_t)snprintf(part, sizeof part, "%s/node-%" PRIu32, dir, node_rank) >=
      sizeof part) {
    snprintf(err, errlen, "%s: path too long", dir);
    return SHARDD_E_INVAL;
  }
  /* world: the spec's, which the part must have (line_job); a restore into
   * it is no resharding */
  return read_restore(reg, part, as_uid, world, nodes, node_rank, 0, name,
                      spec_uid, spec_path, out, err, errlen);
}

shardd_err shardd__checkpoint_restore_read_text(shardd__registry *reg,
                                                const char *label,
                                                const char *text, size_t len,
                                                shardd__ckrestore **out,
                                                char *err, size_t errlen) {
  *out = NULL;
  if (len > SHARDD__MANIFEST_MAX) {
    snprintf(err, errlen, "%s: %zu bytes, more than the %zu MiB a manifest "
             "may have", label, len, SHARDD__MANIFEST_MAX >> 20);
    return SHARDD_E_LIMIT;
  }
  restore *c = calloc(1, sizeof *c);
  if (c == NULL || (c->dir = strdup(label)) == NULL ||
      (c->text = malloc(len + 2)) == NULL) {
    if (c)
      free(c->dir);
    free(c);
    snprintf(err, errlen, "out of memory");
    return SHARDD_E_NO_MEMORY;
  }
  c->reg = reg;
  c->as_uid = -1;
  c->want_uid = -1;
  c->dd = (shardd__ckdir){-1, c->dir, -1};
  /* the daemon's own record: no file whose owner could vouch for it */
  c->job_checked = 1;
  snprintf(c->path, sizeof c->path, "%s", label);
  memcpy(c->text, text, len);
  c->text[len] = '\0';
  c->text_len = len;
  shardd_err rc = shardd__manifest_split_text(c->text, len, c->path,
                                              &c->stop_line, &c->stop_rc,
                                              &c->seal_line, err, errlen);
  if (rc != SHARDD_OK) {
    shardd__checkpoint_restore_free(c);
    return rc;
  }
  *out = c;
  return SHARDD_OK;
}

shardd__job *shardd__checkpoint_restore_job(const shardd__ckrestore *c) {
  return c->job;
}

shardd_err shardd__checkpoint_restore_run(shardd__ckrestore *c, char *err,
                                          size_t errlen) {
  for (size_t i = 0; i < c->nloads; i++) {
    const ld *l = &c->loads[i];
    char *tmp = NULL, *dst = l->direct;
    if (dst == NULL && (dst = tmp = malloc(l->bytes ? l->bytes : 1)) == NULL) {
      snprintf(err, errlen, "out of memory");
      return SHARDD_E_NO_MEMORY;
    }
    shardd_err rc = shardd__ck_load_data(&c->dd, l->file, l->dtype, l->numel,
                                         l->offset, l->name, l->crc, dst,
                                         l->bytes, err, errlen);
    for (size_t k = 0; rc == SHARDD_OK && k < l->ncopies; k++)
      memcpy(l->copies[k].dst, tmp + l->copies[k].src, l->copies[k].n);
    free(tmp);
    if (rc != SHARDD_OK)
      return rc;
  }
  /* host -> device: the staged regions, whole (what no file filled is the
   * zeros the region started with) */
  shardd__backend *be = c->reg->backend;
  for (size_t i = 0; i < c->nshadows; i++) {
    shardd__region *r = c->shadows[i].r;
    shardd_err rc = be->ops->write(be, r, 0, c->shadows[i].host, r->bytes);
    if (rc != SHARDD_OK) {
      snprintf(err, errlen, "writing %zu restored bytes to device %d: %s",
               r->bytes, r->device, shardd_strerror(rc));
      return rc;
    }
  }
  return SHARDD_OK;
}

shardd__job *shardd__checkpoint_restore_finish(shardd__ckrestore *c) {
  for (size_t i = 0; i < c->npo; i++) {
    shardd__optim *o = c->po[i].created;
    for (size_t k = 0; k < o->nshards; k++)
      o->shards[k].master_valid = c->po[i].mv[k];
    o->steps = c->po[i].steps;
    for (size_t k = 0; k < o->nrefs; k++)
      o->ref_steps[k] = c->po[i].ref_steps ? c->po[i].ref_steps[k] : o->steps;
  }
  shardd__job *job = c->job; /* the caller's now; free must not release it */
  c->job = NULL;
  return job;
}

shardd_err shardd__checkpoint_restore(shardd__registry *reg, const char *dir,
                                      int64_t as_uid, uint32_t world,
                                      shardd__job **out, char *err,
                                      size_t errlen) {
  *out = NULL;
  shardd__ckrestore *c;
  shardd_err rc = shardd__checkpoint_restore_prepare(reg, dir, as_uid, world,
                                                     &c, err, errlen);
  if (rc != SHARDD_OK)
    return rc;
  if ((rc = shardd__checkpoint_restore_run(c, err, errlen)) == SHARDD_OK)
    *out = shardd__checkpoint_restore_finish(c);
  shardd__checkpoint_restore_free(c);
  return rc;
}

shardd_err shardd__checkpoint_seal(const char *dir, uint32_t *seal, char *err,
                                   size_t errlen) {
  FILE *f;
  int end_line;
  shardd_err rc = open_sealed(dir, -1, &f, NULL, seal, &end_line, err, errlen);
  if (rc == SHARDD_OK)
    fclose(f);
  return rc;
}

