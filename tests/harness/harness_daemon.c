/* harness_daemon.c — the one daemon of the running test (see
 * daemon_fixture.h). */
#include "daemon_fixture.h"

test_daemon d;

void stop_daemon(void) { test_daemon_finish(&d); }
