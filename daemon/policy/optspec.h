/* optspec.h — an optimizer registration as the core sees it: plain C, no
 * wire type. It holds everything validation, the registration use case
 * (optreg.h) and checkpoint restore read from a client's RegisterOptimizer,
 * field for field, with the proto's presence flags kept: identity of two
 * registrations is their canonical encoding (optcodec.h), and an unset
 * field encodes differently from one set to its default.
 *
 * A leaf header: it includes nothing of the daemon, so any layer may use
 * it. Only daemon/policy/optcodec.c converts it to and from the wire.
 *
 * Ownership: a spec filled by optcodec owns every array and string in it
 * (shardd__optspec_free releases them); one built by hand is the builder's
 * to manage. */
#ifndef SHARDD_OPTSPEC_H
#define SHARDD_OPTSPEC_H

#include <stddef.h>
#include <stdint.h>

/* Every hyperparameter by name, for code that treats them all alike (the
 * codec, the overlay of overrides): X(name) once each. A new one is added
 * here, in the struct below, in shardd__hp and on the wire. */
#define SHARDD__OPTSPEC_HP_FIELDS(X)                                         \
  X(lr) X(momentum) X(dampening) X(weight_decay) X(nesterov) X(maximize)     \
  X(beta1) X(beta2) X(eps) X(amsgrad)

/* Hyperparameter overrides; a field counts only when its has_ flag is set
 * (unset: the kind's torch default, or the optimizer's value in a group). */
typedef struct {
  int has_lr, has_momentum, has_dampening, has_weight_decay;
  int has_nesterov, has_maximize;
  int has_beta1, has_beta2, has_eps, has_amsgrad;
  double lr, momentum, dampening, weight_decay;
  int nesterov, maximize;
  double beta1, beta2, eps;
  int amsgrad;
} shardd__optspec_hp;

/* One parameter: a buffer or view id of the caller's job. */
typedef struct {
  uint64_t id;
  /* the trainer's own name for it, echoed in refusals; NULL when unset
   * ("" is set, and encodes as such) */
  char *name;
  int has_generation; /* generation 0 or unset: not checked */
  uint64_t generation;
} shardd__optspec_ref;

typedef struct {
  shardd__optspec_ref *refs;
  size_t nrefs;
  int has_overrides; /* an empty override block is still "present" */
  shardd__optspec_hp overrides;
} shardd__optspec_group;

typedef struct {
  char *name; /* NULL when unset; NULL or "" register as "default" */
  /* a shardd_optim_kind as sent: validation refuses values outside it */
  int kind;
  int has_hyper;
  shardd__optspec_hp hyper;
  shardd__optspec_group *groups;
  size_t ngroups;
} shardd__optspec;

#endif /* SHARDD_OPTSPEC_H */
