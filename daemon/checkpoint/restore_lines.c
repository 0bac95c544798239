/* restore_lines.c — a restore's manifest lines replayed into its new job
 * (see restore.c's apply phase): the header and the job line checked
 * against who asks, then buffers, shards, views, optimizers, their refs
 * and states, each checked against what the lines before it made. */
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

shardd_err shardd__restore_bad(restore *c, shardd_err rc, const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  snprintf(c->err, c->errlen, "%s line %d: %s", c->path, c->lineno, why);
  return rc == SHARDD_OK ? SHARDD_E_INVAL : rc;
}

/* A line the reader refused (too long, a NUL, no memory, a read error). */
shardd_err shardd__restore_line_error(restore *c, shardd__line_rc lr) {
  return shardd__manifest_line_error(lr, c->path, c->lineno, c->err, c->errlen);
}

shardd_err shardd__restore_line_header(restore *c, char **tok, int nt) {
  char why[512];
  if (shardd__manifest_header(tok, nt, &c->mversion, why, sizeof why) !=
      SHARDD_OK)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "%s", why);
  return SHARDD_OK;
}

/* Whether the files that record owner as a job's owner may say so: the
 * directory (dirfd) and the manifest (filefd) must be owner's or the
 * daemon's. The owner line is only text; without this, root restoring a
 * directory another user wrote (an operator's --restore or Restore)
 * created the victim's job, the victim's own spec and quotas applying,
 * with the writer's weights. */
shardd_err shardd__restore_vouched(int dirfd, int filefd, uint32_t owner,
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
shardd_err shardd__restore_job_check(restore *c, const shardd__mline *ml) {
  const char *name = ml->u.job.name;
  if (c->exit_name && strcmp(name, c->exit_name)) {
    /* another spec's job may have its part here: the caller looks on */
    snprintf(c->err, c->errlen, "%s: a part of job \"%s\", not \"%s\"",
             c->path, name, c->exit_name);
    return SHARDD_E_NOT_FOUND;
  }
  if (c->exit_name && ml->u.job.world != c->exit_world)
    return shardd__restore_bad(c, SHARDD_E_MISMATCH, "job \"%s\" of world %s, but its job "
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
  shardd_err rc = shardd__restore_vouched(c->dd.fd, fileno(c->f), owner, c->path, name,
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "bad job name");
  shardd_err rc;
  if (!c->job_checked && (rc = shardd__restore_job_check(c, ml)) != SHARDD_OK)
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "world %s is out of range [1, %u]",
                               ml->u.job.world_word, SHARDD__WORLD_MAX);
  c->old_world = (uint32_t)ow;
  rc = shardd__job_get(c->reg, name, c->world ? c->world : c->old_world,
                       owner, &c->job, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return shardd__restore_bad(c, rc, "%s", c->sub);
  /* a node's part: laid out before any buffer, as a Hello under the job's
   * spec would have; the origin is compared by every exchange */
  if (c->nodes > 1) {
    rc = shardd__job_set_layout(c->job, c->nodes, c->node_rank, c->sub,
                                sizeof c->sub);
    if (rc != SHARDD_OK)
      return shardd__restore_bad(c, rc, "%s", c->sub);
    c->job->origin = c->origin;
  }
  return SHARDD_OK;
}

/* "node N NODES": the manifest is node N's part of a checkpoint over NODES
 * nodes; it must be the part this restore asked for. */
static shardd_err line_node(restore *c, const shardd__mline *ml) {
  uint32_t n = ml->u.node.node, nodes = ml->u.node.nodes;
  if (c->nodes <= 1)
    return shardd__restore_bad(c, SHARDD_E_INVAL,
                               "this is node %" PRIu32 "'s part of a checkpoint over %" PRIu32
                               " nodes: restore the job checkpoint above it (its directory "
                               "holds the job manifest), on every node",
                               n, nodes);
  if (n != c->node_rank || nodes != c->nodes || c->node_seen)
    return shardd__restore_bad(c, SHARDD_E_MISMATCH,
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "bad buffer name");
  shardd_err rc = shardd__buffer_register(
      c->reg, c->job, ml->u.buffer.name, (shardd_dtype)ml->u.buffer.dtype,
      ml->u.buffer.numel, &b, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return shardd__restore_bad(c, rc, "%s", c->sub);
  if (!created)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "buffer \"%s\" listed twice",
                               ml->u.buffer.name);
  b->settled = 1; /* trainers attach to the restored values */
  /* A restored handle is a new generation: one kept from before the
   * checkpoint is refused as stale. */
  shardd__obj_set_generation(&b->hdr, ml->u.buffer.generation + 1);
  shardd__buffer **nbufs = realloc(c->bufs, (c->nb + 1) * sizeof *c->bufs);
  if (nbufs == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  c->bufs = nbufs;
  uint8_t **nseen = realloc(c->seen, (c->nb + 1) * sizeof *c->seen);
  if (nseen == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  c->seen = nseen;
  if ((c->seen[c->nb] = calloc((c->old_world + 7) / 8, 1)) == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  char **nnames = realloc(c->bnames, (c->nb + 1) * sizeof *c->bnames);
  if (nnames == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  c->bnames = nnames;
  if ((c->bnames[c->nb] = strdup(b->hdr.name)) == NULL) {
    free(c->seen[c->nb]);
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "shard of unknown buffer %zu rank %" PRIu32,
                               bi, r);
  if (c->nodes > 1 && !shardd__job_rank_local(c->job, r))
    return shardd__restore_bad(c, SHARDD_E_MISMATCH,
                               "shard of rank %" PRIu32 ", which is not node %" PRIu32 "'s",
                               r, c->node_rank);
  if (c->seen[bi][r / 8] & (1u << (r % 8)))
    return shardd__restore_bad(c, SHARDD_E_INVAL,
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "malformed view");
  shardd__view *v;
  int created;
  shardd_err rc = shardd__view_register_ex(
      c->reg, c->job, c->bufs[bi]->hdr.id, 0, ml->u.view.name,
      ml->u.view.offset, ml->u.view.numel, ml->u.view.shape, ml->u.view.ndim,
      ml->u.view.requires_grad, &v, &created, c->sub, sizeof c->sub);
  if (rc != SHARDD_OK)
    return shardd__restore_bad(c, rc, "%s", c->sub);
  if (!created)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "view \"%s\" listed twice",
                               ml->u.view.name);
  c->nviews++;
  shardd__obj_set_generation(&v->hdr, ml->u.view.generation + 1);
  return SHARDD_OK;
}

/* "optimizer INDEX NAME STEPS SPEC_HEX": pending until every ref and state
 * line is read; registered after the last line. */
static shardd_err line_optimizer(restore *c, const shardd__mline *ml) {
  if (ml->u.optimizer.index != c->npo || !ml->u.optimizer.name_ok)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "optimizers out of order");
  /* each optimizer owns buffers or views of its own, registered above */
  if (c->npo >= c->nb + c->nviews)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "optimizer %zu, but the lines above "
                               "registered %zu buffers and views for optimizers to own",
                               c->npo, c->nb + c->nviews);
  size_t hl = strlen(ml->u.optimizer.spec_hex);
  if (hl / 2 > SPECS_MAX - c->spec_bytes)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "optimizer registrations of %zu bytes "
                               "together, more than the %zu a manifest may hold", c->spec_bytes
                               + hl / 2, SPECS_MAX);
  c->spec_bytes += hl / 2;
  pending_optim *np = realloc(c->po, (c->npo + 1) * sizeof *c->po);
  if (np == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  c->po = np;
  pending_optim *p = &c->po[c->npo++];
  memset(p, 0, sizeof *p);
  p->name = strdup(ml->u.optimizer.name);
  p->steps = ml->u.optimizer.steps;
  p->spec = malloc(hl / 2 + 1);
  if (p->name == NULL || p->spec == NULL ||
      !shardd__manifest_unhex(ml->u.optimizer.spec_hex, p->spec))
    return shardd__restore_bad(c, SHARDD_E_INVAL, "bad optimizer spec");
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "ref to unknown optimizer or buffer");
  shardd__obj *o = &c->bufs[bi]->hdr;
  if (ml->u.ref.is_view) {
    if (!ml->u.ref.ok ||
        (o = shardd__map_get_str(&c->bufs[bi]->views, ml->u.ref.view)) ==
            NULL)
      return shardd__restore_bad(c, SHARDD_E_INVAL, "ref to unknown view");
  } else if (!ml->u.ref.ok) {
    return shardd__restore_bad(c, SHARDD_E_INVAL, "malformed ref");
  }
  /* an object is owned by one optimizer: one ref line, so their count is
   * bounded by what the lines above registered */
  if (shardd__map_get_id(&c->reffed, o->id))
    return shardd__restore_bad(c, SHARDD_E_INVAL, "a second ref line to buffer %zu's %s",
                               bi, o->name);
  if (shardd__map_put_id(&c->reffed, o->id, o) != SHARDD_OK)
    return shardd__restore_bad(c, SHARDD_E_NO_MEMORY, "out of memory");
  pending_optim *p = &c->po[oi];
  if (shardd__map_put_id(&p->bufs_reffed, (uint64_t)bi + 1, p) != SHARDD_OK)
    return shardd__restore_bad(c, SHARDD_E_NO_MEMORY, "out of memory");
  id_map *ni = realloc(p->ids, (p->nids + 1) * sizeof *ni);
  if (ni == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "state of unknown optimizer or buffer");
  pending_optim *p = &c->po[oi];
  unsigned long rank = ml->u.state.rank;
  int nstate = ml->u.state.nstate;
  if (rank >= c->old_world || nstate < 0 || nstate > 3)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "state of rank %s of a world of %" PRIu32
                               ", or a bad state count", ml->u.state.rank_word,
                               c->old_world);
  /* shardd writes an optimizer's ref lines before its state lines: each
   * state is of a buffer it owns, so their count is bounded by the refs */
  if (!shardd__map_get_id(&p->bufs_reffed, (uint64_t)bi + 1))
    return shardd__restore_bad(c, SHARDD_E_INVAL, "state of buffer %zu, which no ref line of "
                               "optimizer %zu above names", bi, oi);
  uint64_t key = (uint64_t)bi << 17 | rank;
  if (shardd__map_get_id(&p->state_seen, key))
    return shardd__restore_bad(c, SHARDD_E_INVAL, "state of buffer %zu rank %lu listed twice",
                               bi, rank);
  if (shardd__map_put_id(&p->state_seen, key, p) != SHARDD_OK)
    return shardd__restore_bad(c, SHARDD_E_NO_MEMORY, "out of memory");
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "%s/%s states %s bytes, but buffer \"%s\" "
                               "rank %lu of a world of %" PRIu32 " holds %zu bytes of state in "
                               "%d arrays (%zu with a backend's rounding, at most); refused "
                               "unread", c->dd.path, ml->u.state.file, ml->u.state.bytes_word,
                               b->hdr.name, rank,
                               c->old_world, used, nstate,
                               used + SHARDD__REGION_GRAIN_MAX - 1);
  pending_state *ns = realloc(p->states, (p->nstates + 1) * sizeof *ns);
  if (ns == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "out of memory");
  return SHARDD_OK;
}

/* One manifest line, split into words and parsed (manifest.c): the header
 * first, then nothing but the job line until it came, nothing at all after
 * "end". */
shardd_err shardd__restore_apply_line(restore *c, char **tok, int nt) {
  if (c->lineno == 1)
    return shardd__restore_line_header(c, tok, nt);
  if (c->ended)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "text after \"end\"");
  shardd__mline ml;
  shardd__manifest_parse(tok, nt, c->mversion, &ml);
  if (ml.kind == SHARDD__ML_END) {
    if (nt != 2)
      return shardd__restore_bad(c, SHARDD_E_INVAL, "malformed \"end\" line");
    /* the seal was checked on the line that starts "end ": one that only
     * splits into "end" (a leading space) ended the manifest unchecked */
    if (c->lineno != c->seal_line)
      return shardd__restore_bad(c, SHARDD_E_INVAL, "an \"end\" line whose checksum was not "
                                 "checked (not a manifest shardd wrote)");
    c->ended = 1;
    return SHARDD_OK;
  }
  if (ml.kind == SHARDD__ML_JOB && c->job == NULL)
    return line_job(c, &ml);
  if (c->job == NULL)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "\"%s\" before the job line", tok[0]);
  if (ml.kind == SHARDD__ML_NODE)
    return line_node(c, &ml);
  if (c->nodes > 1 && !c->node_seen)
    return shardd__restore_bad(c, SHARDD_E_INVAL, "no \"node\" line after the job line (not "
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
    return rc == SHARDD_OK ? SHARDD_OK : shardd__restore_bad(c, rc, "%s", c->sub);
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
    return shardd__restore_bad(c, SHARDD_E_INVAL, "unknown or malformed line \"%s\"", tok[0]);
  }
}
