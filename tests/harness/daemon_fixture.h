/* daemon_fixture.h — the one daemon of the running test that the system
 * tests with a shared fixture use (defined in harness_daemon.c): .init
 * starts it with the flags its start_* names, .fini stops it. */
#ifndef SHARDD_TEST_DAEMON_FIXTURE_H
#define SHARDD_TEST_DAEMON_FIXTURE_H

#include "harness.h"

extern test_daemon d;

void stop_daemon(void);

#endif
