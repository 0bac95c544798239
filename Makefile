# shardd — top-level build. New files under common/, daemon/ (and its layer
# folders), client/, tests/unit/, tests/system/ and bench/ are picked up by
# wildcard, so adding a module needs no edit here.
#
#   make            shardd, libshardd.{so,a}, shardctl
#   make test       the whole suite (installs missing Debian packages first)
#   make check      the suite again with -Werror, ASan and UBSan
#   make install    PREFIX=/usr/local DESTDIR=
#   make CUDA=0     build without the cuda backend even where nvcc exists

PREFIX ?= /usr/local
DESTDIR ?=
BUILD ?= build
SAN ?= 0

CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
ifeq ($(origin CUDA),undefined)
CUDA := $(shell test -x $(NVCC) && test -f $(CUDA_HOME)/include/cuda_runtime.h && echo 1 || echo 0)
endif
CUDA_ARCH ?= -arch=sm_90
# benches are tuned for the CPU they run on; gpu_pack.sh builds for another
BENCH_MARCH ?= -march=native

# The one version string is SHARDD_VERSION in include/shardd.h.
VERSION := $(shell sed -n 's/^\#define SHARDD_VERSION "\(.*\)"/\1/p' include/shardd.h)

CC ?= cc
PKGS := libuv libprotobuf-c
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

WARN := -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter
OPT ?= -O2 -g
# Each folder of a layer is on the include path, so a file names what it
# includes by its name alone ("registry.h") wherever the two files live;
# scripts/check_layers.py keeps those names unique and the edges downward.
DAEMON_DIRS := $(patsubst %/,%,$(sort $(dir $(wildcard daemon/*/*.c daemon/*/*.h))))
INC := -Iinclude -Icommon -Iclient -Idaemon $(addprefix -I,$(DAEMON_DIRS))
CFLAGS_ALL = -std=c11 -D_GNU_SOURCE $(OPT) $(WARN) -fPIC -pthread \
  -I$(BUILD)/gen $(INC) $(PKG_CFLAGS) $(CFLAGS)
LDLIBS_ALL = $(PKG_LIBS) -lpthread -lm -ldl $(LDLIBS)

ifeq ($(SAN),1)
CFLAGS_ALL += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS += -fsanitize=address,undefined
endif

CUDA_SRC := $(wildcard daemon/backend/backend_cuda.c)
CU_SRC := $(wildcard daemon/*/*.cu)
ifeq ($(CUDA),1)
CFLAGS_ALL += -DSHARDD_HAVE_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS_ALL += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lnccl -lstdc++
DAEMON_CUDA_OBJ := $(CUDA_SRC:%.c=$(BUILD)/%.o) $(CU_SRC:%.cu=$(BUILD)/%.cu.o)
endif

PROTO_C := $(BUILD)/gen/proto/shardd.pb-c.c
PROTO_H := $(BUILD)/gen/proto/shardd.pb-c.h
PROTO_O := $(BUILD)/gen/proto/shardd.pb-c.o

LIB_SRC := $(wildcard common/*.c) $(filter-out client/shardctl.c,$(wildcard client/*.c))
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o) $(PROTO_O)
DAEMON_SRC := $(filter-out daemon/main.c $(CUDA_SRC),$(wildcard daemon/*.c daemon/*/*.c))
DAEMON_OBJ := $(DAEMON_SRC:%.c=$(BUILD)/%.o) $(DAEMON_CUDA_OBJ)
# tests/unit/: in-process tests of modules; tests/system/: tests against a
# real daemon, on tests/harness/. Their binaries share one folder.
TEST_SRC := $(wildcard tests/unit/test_*.c tests/system/test_*.c)
# a test left in tests/ itself would silently never run
ifneq ($(wildcard tests/test_*.c),)
$(error $(wildcard tests/test_*.c): a test goes in tests/unit/ (in process) or tests/system/ (against a daemon))
endif
TEST_BIN := $(addprefix $(BUILD)/tests/,$(basename $(notdir $(TEST_SRC))))
BENCH_SRC := $(wildcard bench/*.c)
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)

SHARDD := $(BUILD)/shardd
SHARDCTL := $(BUILD)/shardctl
LIBSO := $(BUILD)/libshardd.so
LIBA := $(BUILD)/libshardd.a
DAEMONA := $(BUILD)/libshardd_daemon.a

.PHONY: all test check deps install clean bench tests demo fuzz
all: $(SHARDD) $(SHARDCTL) $(LIBSO) $(LIBA) $(BUILD)/libshardd.pc

# Objects depend on the configuration, so switching CUDA or SAN in one
# build folder rebuilds instead of linking a mix.
CONFIG_STAMP := $(BUILD)/.config-cuda$(CUDA)-san$(SAN)
$(CONFIG_STAMP):
	@mkdir -p $(BUILD)
	@rm -f $(BUILD)/.config-*
	@touch $@

# The generated sources do not depend on the configuration (gpu_check.sh
# brings them to machines without protoc-c); their object does.
$(PROTO_C) $(PROTO_H): proto/shardd.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --c_out=$(BUILD)/gen proto/shardd.proto

$(PROTO_O): $(PROTO_C) $(CONFIG_STAMP)
	$(CC) $(CFLAGS_ALL) -Wno-shadow -c $< -o $@

$(BUILD)/%.o: %.c $(PROTO_H) $(CONFIG_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu $(wildcard daemon/*/*_cuda.h) $(CONFIG_STAMP)
	@mkdir -p $(@D)
	$(NVCC) $(CUDA_ARCH) -O3 -std=c++17 -Xcompiler -fPIC $(INC) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

$(LIBA): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# The client side needs protobuf-c only: no libuv, no CUDA (libcudart is
# dlopen()ed at run time for CUDA IPC handles, hence -ldl).
CLIENT_LIBS := $(shell pkg-config --libs libprotobuf-c 2>/dev/null) -lpthread -ldl

$(LIBSO): $(LIB_OBJ)
	$(CC) -shared $(LDFLAGS) -Wl,-soname,libshardd.so.0 -o $@ $^ $(CLIENT_LIBS)

$(DAEMONA): $(DAEMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SHARDD): $(BUILD)/daemon/main.o $(DAEMONA) $(LIBA)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS_ALL)

$(SHARDCTL): $(BUILD)/client/shardctl.o $(LIBA)
	$(CC) $(LDFLAGS) -o $@ $^ $(CLIENT_LIBS)

$(BUILD)/libshardd.pc: client/libshardd.pc.in include/shardd.h
	@mkdir -p $(@D)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

$(BUILD)/tests/%: tests/unit/%.c $(DAEMONA) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(DAEMONA) $(LIBA) $(LDFLAGS) -lcriterion $(LDLIBS_ALL)

# The system tests' helpers, compiled once into one archive: a test binary
# links only the files whose functions and fixtures (its *_fixture.h) it
# uses, so one fixture's globals (d, setup, reg, ...) are not in every test.
HARNESS_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard tests/harness/harness*.c))
HARNESS_A := $(BUILD)/tests/libharness.a
$(HARNESS_A): $(HARNESS_OBJ)
	@rm -f $@
	ar rcs $@ $^
$(BUILD)/tests/%: tests/system/%.c $(HARNESS_A) $(DAEMONA) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Itests/harness -o $@ $< $(TEST_HOOKS_OBJ) $(HARNESS_A) $(DAEMONA) $(LIBA) $(LDFLAGS) -lcriterion $(LDLIBS_ALL)

# test_server runs the server in process with its fault hook
# (shardd__server_fail_replies): a server.o with SHARDD_TEST_HOOKS, linked
# ahead of the archive, whose server.o (the daemon's) checks nothing per reply.
HOOKS_SERVER_O := $(BUILD)/tests/hooks/server.o
$(HOOKS_SERVER_O): daemon/net/server.c $(PROTO_H) $(CONFIG_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -DSHARDD_TEST_HOOKS=1 -MMD -MP -c $< -o $@
$(BUILD)/tests/test_server: TEST_HOOKS_OBJ = $(HOOKS_SERVER_O)
$(BUILD)/tests/test_server: $(HOOKS_SERVER_O)

# Stand-in CUDA runtimes test_client loads from beside itself
# (tests/harness/fake_cudart.c): one with the driver's range call, one without.
FAKE_CUDART := $(BUILD)/tests/libfake_cudart.so $(BUILD)/tests/libfake_cudart_norange.so
$(BUILD)/tests/test_client: | $(FAKE_CUDART)
$(BUILD)/tests/libfake_cudart.so: tests/harness/fake_cudart.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -shared -o $@ $<
$(BUILD)/tests/libfake_cudart_norange.so: tests/harness/fake_cudart.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -DFAKE_NO_RANGE -shared -o $@ $<

$(BUILD)/bench/%: bench/%.c $(DAEMONA) $(LIBA)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -O3 $(BENCH_MARCH) -o $@ $< $(DAEMONA) $(LIBA) $(LDFLAGS) $(LDLIBS_ALL)

# libFuzzer over the whole request path (tests/fuzz/fuzz_request.c), built
# with clang from the sources; runs FUZZ_SECONDS on a copy of the seeds.
FUZZ_SECONDS ?= 60
FUZZ_BIN := $(BUILD)/fuzz/fuzz_request
FUZZ_SRC := $(LIB_SRC) $(DAEMON_SRC) $(PROTO_C) tests/fuzz/fuzz_request.c
$(FUZZ_BIN): $(FUZZ_SRC) $(PROTO_H) $(wildcard include/*.h common/*.h client/*.h daemon/*.h daemon/*/*.h) tests/fuzz/fuzz_util.h
	@mkdir -p $(@D)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined -I$(BUILD)/gen $(INC) \
	  $(PKG_CFLAGS) -o $@ $(FUZZ_SRC) $(PKG_LIBS) -lpthread -lm

# The checkpoint manifest parser and the restore it drives
# (tests/fuzz/fuzz_manifest.c; seeds in tests/fuzz/corpus_manifest/).
FUZZM_BIN := $(BUILD)/fuzz/fuzz_manifest
FUZZM_SRC := $(LIB_SRC) $(DAEMON_SRC) $(PROTO_C) tests/fuzz/fuzz_manifest.c
$(FUZZM_BIN): $(FUZZM_SRC) $(PROTO_H) $(wildcard include/*.h common/*.h client/*.h daemon/*.h daemon/*/*.h) tests/fuzz/fuzz_util.h
	@mkdir -p $(@D)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined -I$(BUILD)/gen $(INC) \
	  $(PKG_CFLAGS) -o $@ $(FUZZM_SRC) $(PKG_LIBS) -lpthread -lm

# The --job-spec parser (tests/fuzz/fuzz_jobspec.c; seeds in
# tests/fuzz/corpus_jobspec/): a leaf, so only jobspec.c is built in.
FUZZJ_BIN := $(BUILD)/fuzz/fuzz_jobspec
FUZZJ_SRC := daemon/jobs/jobspec.c tests/fuzz/fuzz_jobspec.c
$(FUZZJ_BIN): $(FUZZJ_SRC) daemon/jobs/jobspec.h include/shardd.h
	@mkdir -p $(@D)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined $(INC) -o $@ $(FUZZJ_SRC)

# Several ranks of one job over two or three connections
# (tests/fuzz/fuzz_ranks.c; seeds in tests/fuzz/corpus_ranks/).
FUZZR_BIN := $(BUILD)/fuzz/fuzz_ranks
FUZZR_SRC := $(LIB_SRC) $(DAEMON_SRC) $(PROTO_C) tests/fuzz/fuzz_ranks.c
$(FUZZR_BIN): $(FUZZR_SRC) $(PROTO_H) $(wildcard include/*.h common/*.h client/*.h daemon/*.h daemon/*/*.h) tests/fuzz/fuzz_util.h
	@mkdir -p $(@D)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined -I$(BUILD)/gen $(INC) \
	  $(PKG_CFLAGS) -o $@ $(FUZZR_SRC) $(PKG_LIBS) -lpthread -lm

# The fd store's description text and the adoption it drives at a restart
# (tests/fuzz/fuzz_fdstore.c; seeds in tests/fuzz/corpus_fdstore/).
FUZZF_BIN := $(BUILD)/fuzz/fuzz_fdstore
FUZZF_SRC := $(LIB_SRC) $(DAEMON_SRC) $(PROTO_C) tests/fuzz/fuzz_fdstore.c
$(FUZZF_BIN): $(FUZZF_SRC) $(PROTO_H) $(wildcard include/*.h common/*.h client/*.h daemon/*.h daemon/*/*.h) tests/fuzz/fuzz_util.h
	@mkdir -p $(@D)
	clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined -I$(BUILD)/gen $(INC) \
	  $(PKG_CFLAGS) -o $@ $(FUZZF_SRC) $(PKG_LIBS) -lpthread -lm

fuzz: $(FUZZ_BIN) $(FUZZM_BIN) $(FUZZJ_BIN) $(FUZZR_BIN) $(FUZZF_BIN)
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) sh scripts/run_fuzz.sh $(FUZZ_BIN) $(FUZZM_BIN) $(FUZZJ_BIN) $(FUZZR_BIN) $(FUZZF_BIN)

# The fuzzer joins the suite where clang can build libFuzzer targets.
HAVE_FUZZ := $(shell echo 'int LLVMFuzzerTestOneInput(const char *d, long n){return 0;}' | \
  clang -x c -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1 && echo 1)
ifeq ($(SAN)$(HAVE_FUZZ),01)
SUITE_FUZZ := $(FUZZ_BIN) $(FUZZM_BIN) $(FUZZJ_BIN) $(FUZZR_BIN) $(FUZZF_BIN)
endif

tests: all $(TEST_BIN) $(SUITE_FUZZ)

deps:
	@sh scripts/deps.sh

test: deps
	@$(MAKE) --no-print-directory tests
	@BUILD=$(BUILD) FUZZ_BIN="$(SUITE_FUZZ)" sh scripts/run_tests.sh $(TEST_BIN)

check: deps
	@$(MAKE) --no-print-directory BUILD=build/check SAN=1 OPT="-O1 -g" tests
	@BUILD=build/check ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  sh scripts/run_tests.sh $(TEST_BIN:$(BUILD)/%=build/check/%)

# The main job: a host-backend daemon and a 4-rank demo trainer.
demo: deps
	@$(MAKE) --no-print-directory all
	/usr/bin/python3 examples/train_mlp.py --ranks 4 --steps 50 --start-daemon --shardd $(BUILD)/shardd

bench: all $(BENCH_BIN)
	@BUILD=$(BUILD) FULL=$(FULL) sh bench/run.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig \
	  $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/systemd/system \
	  $(DESTDIR)$(PREFIX)/lib/sysusers.d $(DESTDIR)$(PREFIX)/lib/tmpfiles.d
	install -m 0755 $(SHARDD) $(SHARDCTL) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(LIBA) $(DESTDIR)$(PREFIX)/lib/
	install -m 0755 $(LIBSO) $(DESTDIR)$(PREFIX)/lib/libshardd.so.0
	ln -sf libshardd.so.0 $(DESTDIR)$(PREFIX)/lib/libshardd.so
	install -m 0644 include/shardd.h $(DESTDIR)$(PREFIX)/include/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' client/libshardd.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/libshardd.pc
	cp $(DESTDIR)$(PREFIX)/lib/pkgconfig/libshardd.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/shardd.pc
	sed 's|@BINDIR@|$(PREFIX)/bin|g' systemd/shardd.service.in > $(DESTDIR)$(PREFIX)/lib/systemd/system/shardd.service
	install -m 0644 systemd/shardd.socket $(DESTDIR)$(PREFIX)/lib/systemd/system/
	install -m 0644 systemd/shardd.sysusers $(DESTDIR)$(PREFIX)/lib/sysusers.d/shardd.conf
	install -m 0644 systemd/shardd.tmpfiles $(DESTDIR)$(PREFIX)/lib/tmpfiles.d/shardd.conf

clean:
	rm -rf build

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
$(BUILD)/daemon/kernels/optim.o: OPT = -O3 -g -fno-math-errno
# The reduce and convert loops of scatter vectorize only at -O3.
$(BUILD)/daemon/backend/backend_host.o: OPT = -O3 -g
$(BUILD)/daemon/kernels/reduce.o: OPT = -O3 -g

# ---- Gloo: the host fabric for jobs over several nodes ----------------------
# GLOO=1 when Debian's libgloo-dev is installed (override with GLOO=0/1).
# daemon/fabric/*.cc are compiled with g++ and libgloo linked only then; without
# it daemon/fabric/fabric_stub.c refuses multi-node jobs and everything else
# builds.
CXX ?= g++
ifeq ($(origin GLOO),undefined)
GLOO := $(shell test -f /usr/include/gloo/allgather.h && echo 1 || echo 0)
endif
GLOO_STAMP := $(BUILD)/.gloo$(GLOO)
$(GLOO_STAMP):
	@mkdir -p $(BUILD)
	@rm -f $(BUILD)/.gloo*
	@touch $@
# the objects that see SHARDD_HAVE_GLOO rebuild when it flips
$(BUILD)/daemon/fabric/fabric_stub.o: $(GLOO_STAMP)
ifeq ($(GLOO),1)
CFLAGS_ALL += -DSHARDD_HAVE_GLOO=1
LDLIBS_ALL += -lgloo -lstdc++
GLOO_SAN_1 := -fsanitize=address,undefined -fno-omit-frame-pointer
CXXFLAGS_ALL = -std=c++17 $(OPT) -Wall -Wextra -Wno-unused-parameter -fPIC -pthread \
  $(INC) $(GLOO_SAN_$(SAN)) $(CXXFLAGS)
GLOO_OBJ := $(patsubst %.cc,$(BUILD)/%.o,$(wildcard daemon/fabric/*.cc))
$(BUILD)/daemon/fabric/%.o: daemon/fabric/%.cc daemon/fabric/fabric.h $(GLOO_STAMP) $(CONFIG_STAMP)
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS_ALL) -c $< -o $@
$(DAEMONA): $(GLOO_OBJ)
endif
