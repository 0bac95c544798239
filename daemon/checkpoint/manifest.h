/* manifest.h — the text of a checkpoint's manifest, below write and
 * restore (inside the checkpoint module; checkpoint.h is its public
 * interface): name encoding, bounded line reading and the seal check.
 * Names are percent-encoded so any byte string survives the
 * space-separated format. */
#ifndef SHARDD_MANIFEST_H
#define SHARDD_MANIFEST_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "shardd.h"
#include "strbuf.h"

#define SHARDD__MANIFEST_FILE "manifest"
/* The first word of a manifest (of one node's job, or of a node's part). */
#define SHARDD__MANIFEST_MAGIC "shardd-checkpoint"
/* The manifest's own version. 2 recorded each buffer's and view's
 * generation and each view's requires_grad. Version 3 seals the manifest:
 * its "end" line carries the CRC32C of every byte before it, checked before
 * any line is acted upon; restore refuses versions 1 and 2, which carry no
 * seal (an edited step count in one was taken as written). Version 4 ends
 * each "ref" line with the steps that ref took (torch's per-parameter
 * state["step"]; a skipped parameter's stays); before it every ref was
 * stepped by every step, so a version 3 manifest restores each ref with its
 * optimizer's count. Version 5 is a node's part of a multi-node checkpoint
 * ("node" and "lineage" lines after the job line), so a daemon that reads
 * up to 4 refuses it at its header; single-node manifests are still
 * written as 4, which such a daemon restores. Data file headers keep
 * SHARDD_CHECKPOINT_VERSION. */
#define SHARDD_MANIFEST_VERSION 5
/* The oldest version restore accepts: the first that is sealed. */
#define SHARDD_MANIFEST_SEALED 3
#define SHARDD_MANIFEST_VERSION_SINGLE 4
/* The first word of a multi-node job's job-level manifest (checkpoint.h);
 * a node's part is an ordinary manifest in DIR/node-N. */
#define SHARDD__JOB_MANIFEST_MAGIC "shardd-job-checkpoint"
#define SHARDD__JOB_MANIFEST_VERSION 1

/* The longest manifest line restore reads (and write produces). The
 * longest one is an optimizer's: its RegisterOptimizer in hex, with its
 * name and step count. A client's registration fits one frame, but a
 * restored one is repacked with new ids and generations (longer varints),
 * so the cap allows a spec of two frames; write refuses past it rather than
 * leave a checkpoint restore would refuse. The manifest comes from a
 * directory the client names, and getline grew its buffer to whatever one
 * line held: a planted manifest without newlines cost its size in memory. */
#define SHARDD__MANIFEST_LINE_MAX ((size_t)4 * SHARDD_MAX_FRAME + 4096)

/* The largest manifest restore reads, checked on its size before a byte is
 * read (write refuses to leave a larger one). Restore holds the text whole
 * while it checks the seal and splits the lines off the loop thread, then
 * the loads and states its lines plan (about three times the text): the
 * cap keeps one restore near 1 GiB. A manifest takes about 40 bytes per
 * shard file and 80 per optimizer state file: 256 MiB is millions of data
 * files, each a file of its own in the directory. A planted 1.5 GB
 * manifest held the loop 4-6 s, and its plans would have held ~4.5 GB. */
#define SHARDD__MANIFEST_MAX ((size_t)256 << 20)

/* Appends s to sb percent-encoded (bytes <= 0x20, >= 0x7f and '%'). */
void shardd__manifest_enc_name(shardd__sb *sb, const char *s);
/* Decodes s in place; returns 0 on a malformed escape or an escaped NUL. */
int shardd__manifest_dec_name(char *s);
/* The value of a lowercase hex digit, -1 for anything else. */
int shardd__manifest_hexval(char c);

typedef enum {
  SHARDD__LINE_OK,
  SHARDD__LINE_EOF,
  SHARDD__LINE_LONG,
  SHARDD__LINE_NUL,
  SHARDD__LINE_NOMEM,
  SHARDD__LINE_IO
} shardd__line_rc;

/* Reads the next line of f, without its newline, into *buf (the caller's,
 * grown with realloc to at most max + 1 bytes; free() it). */
shardd__line_rc shardd__manifest_read_line(FILE *f, char **buf, size_t *cap,
                                           size_t max);

/* Checks the seal of a manifest (the CRC32C on its "end" line) before any
 * line is acted upon, then rewinds f: SHARDD_E_INVAL with err naming path
 * and line when it does not match. *seal is the checked CRC and *end_line
 * the number of the line it was checked on; 0 when the manifest has no
 * such line (an unsealed version, or truncated: the parser says which).
 * A reader takes the manifest as sealed only when its own "end" line is
 * line *end_line: another line it reads as "end" (" end 0", say) was not
 * checked. */
shardd_err shardd__manifest_verify_seal(FILE *f, const char *path,
                                        uint32_t *seal, int *end_line,
                                        char *err, size_t errlen);

/* A line's words: at most this many are looked at. */
#define SHARDD__MANIFEST_MAX_TOK 64
/* Splits line (NUL-ended) into its words, in place, at most
 * SHARDD__MANIFEST_MAX_TOK of them; the number of words. */
int shardd__manifest_split_words(char *line, char **tok);

/* text (n bytes and a NUL) is a manifest read whole: ends each line with a
 * NUL where its newline was and checks the seal (the CRC32C on its "end"
 * line, of every byte before it): SHARDD_E_INVAL with err naming path and
 * line on a mismatch, before any line is acted upon; *seal_line is the
 * "end" line checked (untouched when none). A line the line reader would
 * refuse (too long, a NUL byte) stops the split: *stop_line is its number
 * and *stop_rc why (untouched when none). */
shardd_err shardd__manifest_split_text(char *text, size_t n, const char *path,
                                       int *stop_line, shardd__line_rc *stop_rc,
                                       int *seal_line, char *err,
                                       size_t errlen);
/* Why line lineno of path was refused by the reader, in err; the code. */
shardd_err shardd__manifest_line_error(shardd__line_rc lr, const char *path,
                                       int lineno, char *err, size_t errlen);
/* Checks a manifest's header line's words (the magic, a version restore
 * reads and sealed): SHARDD_OK with *version, or SHARDD_E_INVAL with why
 * (*version set once the magic matched). */
shardd_err shardd__manifest_header(char **tok, int nt, int *version, char *why,
                                   size_t whylen);

#endif /* SHARDD_MANIFEST_H */
