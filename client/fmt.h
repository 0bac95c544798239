/* fmt.h — renders Status and Inspect replies as `key: value` text for
 * people or as one JSON document for scripts; shared by libshardd's
 * shardd_status_* / shardd_inspect_* and by shardctl. Results are
 * caller-freed with free(); NULL when out of memory. */
#ifndef SHARDD_FMT_H
#define SHARDD_FMT_H

#include "proto/shardd.pb-c.h"

char *shardd__fmt_status_text(const Shardwire__StatusReply *st);
char *shardd__fmt_status_json(const Shardwire__StatusReply *st);
char *shardd__fmt_inspect_text(const Shardwire__InspectReply *ir);
char *shardd__fmt_inspect_json(const Shardwire__InspectReply *ir);

#endif /* SHARDD_FMT_H */
