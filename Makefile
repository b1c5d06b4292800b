# SPDX-License-Identifier: Apache-2.0
# mok: mokd, libmok, mokctl, tests.
#
#   make            release build into build/
#   make debug      debug build (-O0, assertions) into build/debug/
#   make test       build and run every test; ends with "N passed, N failed"
#   make setup      install missing Debian packages (as root)
#   make gpu        CUDA kernels only (needs nvcc)
#
# CUDA parts build when nvcc is found (NVCC=... to point at one; NVCC= to
# skip them) and are skipped cleanly otherwise.

MODE ?= release
BUILD ?= build
CC ?= gcc
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
PROTOC_C ?= protoc-c
PYTHON ?= $(shell for p in python3 /usr/bin/python3; do $$p -c 'import numpy' 2>/dev/null && { command -v $$p; break; }; done)

WARN := -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter -Wstrict-prototypes
CFLAGS_COMMON := -std=c11 -D_GNU_SOURCE -pthread -fPIC -ffp-contract=off -g $(WARN)
ifeq ($(MODE),debug)
  CFLAGS_MODE := -O0
else
  CFLAGS_MODE := -O2 -DNDEBUG
endif
SAN ?=
ifneq ($(SAN),)
  CFLAGS_MODE += -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all
  LDFLAGS_SAN := -fsanitize=$(SAN)
  # TSan does not model atomic_thread_fence; the rings' fences only order
  # atomics (the doorbell handshake), which TSan checks without them
  ifneq ($(findstring thread,$(SAN)),)
    CFLAGS_MODE += -Wno-tsan
  endif
endif

GEN := $(BUILD)/gen
OBJ := $(BUILD)/obj
INCLUDES := -Iproto -I$(GEN) -Idaemon -Iclient/include -Iclient/src -Ikernels -Itests -Itests/ref
CFLAGS += $(CFLAGS_COMMON) $(CFLAGS_MODE) $(INCLUDES)
DEPFLAGS = -MMD -MP

UV_LIBS := $(shell pkg-config --libs libuv 2>/dev/null || echo -luv)
PB_LIBS := $(shell pkg-config --libs libprotobuf-c 2>/dev/null || echo -lprotobuf-c)
SD_LIBS := $(shell pkg-config --libs libsystemd 2>/dev/null || echo -lsystemd)
LDLIBS := -lm -lpthread

# ---- sources --------------------------------------------------------------
PROTO_SRC := $(wildcard proto/*.c)
GEN_SRC := $(GEN)/mok.pb-c.c
# the daemon: the loop, the socket and sessions in daemon/, one folder per
# engine (cpu/, cuda/) and one for expert-parallel groups (ep/); the cuda
# engine's folder builds only with CUDA
DAEMON_DIRS := daemon daemon/cpu daemon/cuda daemon/ep
CUDA_ONLY_SRC := $(wildcard daemon/cuda/*.c)
DAEMON_SRC := $(filter-out daemon/main.c $(CUDA_ONLY_SRC),$(wildcard $(addsuffix /*.c,$(DAEMON_DIRS))))
CLIENT_SRC := $(wildcard client/src/*.c)
REF_SRC := $(wildcard tests/ref/*.c)
UNIT_SRC := $(wildcard tests/unit/test_*.c tests/integration/test_*.c)
BENCH_SRC := $(wildcard tests/bench/*.c)
KERNEL_SRC := $(wildcard kernels/*.cu) kernels/cutlass_gemm/launch.cu
# CUTLASS's headers (deploy/cutlass.sh, run by deploy/setup.sh): with them the
# CUTLASS configurations build (kernels/cutlass_gemm/cfg_*.cu), each its own unit
CUTLASS_DIR ?= .deps/cutlass-4.2.0
HAVE_CUTLASS := $(if $(wildcard $(CUTLASS_DIR)/include/cutlass/cutlass.h),1)
ifneq ($(HAVE_CUTLASS),)
  KERNEL_SRC += $(wildcard kernels/cutlass_gemm/cfg_*.cu)
endif

ifneq ($(NVCC),)
  HAVE_CUDA := 1
  CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
  NVCCFLAGS ?= -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Ikernels -Iproto
  CUDA_DAEMON_SRC := $(CUDA_ONLY_SRC)
  # never -lcuda: machines without a GPU have no libcuda.so.1 at run time;
  # the static runtime loads the driver lazily (daemon/cuda/engine.c)
  CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
else
  HAVE_CUDA :=
endif

o = $(patsubst %.c,$(OBJ)/%.o,$(1))

WIRE_OBJ := $(call o,$(PROTO_SRC)) $(OBJ)/gen/mok.pb-c.o
DAEMON_OBJ := $(call o,$(DAEMON_SRC))
CLIENT_OBJ := $(call o,$(CLIENT_SRC))
REF_OBJ := $(call o,$(REF_SRC))

# The kernel library does not depend on the C flags (sanitizers included):
# `make sanitize` builds it once, in $(KBUILD), for every pass.
KBUILD ?= $(BUILD)
KLIB := $(KBUILD)/lib/libmokkernels.a
ifneq ($(HAVE_CUDA),)
  KERNEL_OBJ := $(patsubst %.cu,$(KBUILD)/obj/%.o,$(KERNEL_SRC))
  ifneq ($(wildcard $(CUDA_DAEMON_SRC)),)
    DAEMON_OBJ += $(call o,$(CUDA_DAEMON_SRC))
    CFLAGS += -DMOK_HAVE_CUDA=1 -I$(CUDA_HOME)/include
    DAEMON_LIBS_CUDA := $(KLIB) $(CUDA_LIBS)
  endif
endif

BINS := $(BUILD)/bin/mokd $(BUILD)/bin/mokctl
LIBS := $(BUILD)/lib/libmok.so $(BUILD)/lib/libmok.a
UNIT_BINS := $(addprefix $(BUILD)/tests/,$(basename $(notdir $(UNIT_SRC))))
BENCH_BINS := $(patsubst tests/bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

.PHONY: all debug test unit setup clean gpu gpu-tests bench install uninstall units \
	fuzz fuzz-smoke fuzz-build fuzz-check sanitize
# keep intermediate objects (bench and test objects are built through chains of
# pattern rules): no rebuilds, and no "rm" lines after the test summary
.SECONDARY:
all: $(BINS) $(LIBS) $(UNIT_BINS) $(BENCH_BINS)

debug:
	$(MAKE) MODE=debug BUILD=build/debug all

# ---- generated protobuf code ----------------------------------------------
$(GEN)/mok.pb-c.c $(GEN)/mok.pb-c.h: proto/mok.proto
	@mkdir -p $(GEN)
	$(PROTOC_C) --proto_path=proto --c_out=$(GEN) proto/mok.proto

# The build's configuration (with or without CUDA) as a file: switching it in
# one build folder rebuilds objects and archives instead of mixing the two.
CONFIG_STAMP := $(BUILD)/.config-$(if $(HAVE_CUDA),cuda,nocuda)$(if $(SAN),-san)
$(CONFIG_STAMP):
	@mkdir -p $(BUILD)
	@rm -f $(BUILD)/.config-*
	@touch $@

# every object may include the generated header
$(OBJ)/%.o: %.c $(GEN)/mok.pb-c.h $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(DEPFLAGS) -c $< -o $@

$(OBJ)/gen/mok.pb-c.o: $(GEN)/mok.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-error -c $< -o $@

KERNEL_HEADERS := $(wildcard kernels/*.h kernels/*.cuh kernels/common/*.cuh kernels/cutlass_gemm/*.h) \
	proto/mok_layout.h
# KERNEL_NVCC_EXTRA: flags for the kernels alone (the build scripts' -Xptxas -v)
KERNEL_NVCC = $(NVCC) $(NVCCFLAGS) $(KERNEL_NVCC_EXTRA) $(if $(HAVE_CUTLASS),-DMOK_HAVE_CUTLASS=1)
$(KBUILD)/obj/kernels/%.o: kernels/%.cu $(KERNEL_HEADERS)
	@mkdir -p $(dir $@)
	$(KERNEL_NVCC) -c $< -o $@

# CUTLASS's units: its headers, NDEBUG (asserts in its device code would
# serialise the wgmma pipeline) and constexpr calls across host and device
CUTLASS_FLAGS := -DNDEBUG --expt-relaxed-constexpr -I$(CUTLASS_DIR)/include \
	-I$(CUTLASS_DIR)/tools/util/include
$(KBUILD)/obj/kernels/cutlass_gemm/cfg_%.o: kernels/cutlass_gemm/cfg_%.cu $(wildcard kernels/cutlass_gemm/*.cuh) $(KERNEL_HEADERS)
	@mkdir -p $(dir $@)
	$(KERNEL_NVCC) $(CUTLASS_FLAGS) -c $< -o $@

# ---- libraries and programs -------------------------------------------------
$(BUILD)/lib/libmokwire.a: $(WIRE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^

$(BUILD)/lib/libmokd.a: $(DAEMON_OBJ) $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $(filter %.o,$^)

$(KLIB): $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^

$(BUILD)/lib/libmok.a: $(CLIENT_OBJ) $(WIRE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && $(AR) rcs $@ $^

# libmok.so exports mok.h's MOK_EXTERN functions alone, versioned MOK_1
# (client/libmok.map; tests/unit/test_exports.c checks the list)
$(CLIENT_OBJ) $(WIRE_OBJ): CFLAGS += -fvisibility=hidden
$(BUILD)/lib/libmok.so: $(CLIENT_OBJ) $(WIRE_OBJ) client/libmok.map
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libmok.so.1 -Wl,--version-script=client/libmok.map $(LDFLAGS_SAN) \
		-o $@ $(filter %.o,$^) $(PB_LIBS) $(LDLIBS)

DAEMON_DEPS := $(BUILD)/lib/libmokd.a $(BUILD)/lib/libmokwire.a $(if $(DAEMON_LIBS_CUDA),$(KLIB))
DAEMON_LINK := $(BUILD)/lib/libmokd.a $(BUILD)/lib/libmokwire.a $(DAEMON_LIBS_CUDA) $(UV_LIBS) $(PB_LIBS) $(SD_LIBS) $(LDLIBS)

$(BUILD)/bin/mokd: $(OBJ)/daemon/main.o $(DAEMON_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_SAN) -o $@ $< $(DAEMON_LINK)

$(BUILD)/bin/mokctl: $(OBJ)/client/tools/mokctl.o $(BUILD)/lib/libmok.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_SAN) -o $@ $^ $(PB_LIBS) $(LDLIBS)

# unit tests link the daemon and client libraries and the f64 reference
define test_rule
$(BUILD)/tests/$(basename $(notdir $(1))): $(call o,$(1)) $(REF_OBJ) $(DAEMON_DEPS) $(BUILD)/lib/libmok.a
	@mkdir -p $$(dir $$@)
	$(CC) $(LDFLAGS_SAN) -o $$@ $$< $(REF_OBJ) $(BUILD)/lib/libmok.a $(DAEMON_LINK)
endef
$(foreach t,$(UNIT_SRC),$(eval $(call test_rule,$(t))))

$(BUILD)/bench/%: $(OBJ)/tests/bench/%.o $(REF_OBJ) $(DAEMON_DEPS) $(BUILD)/lib/libmok.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_SAN) -o $@ $< $(REF_OBJ) $(BUILD)/lib/libmok.a $(DAEMON_LINK)

# the cuda engine's device test (tests/gpu/run_device_tests.sh runs it; make test does not)
ifneq ($(DAEMON_LIBS_CUDA),)
GPU_TEST_BINS := $(BUILD)/tests/gpu/test_cuda_engine
all: $(GPU_TEST_BINS)
endif
$(BUILD)/tests/gpu/test_cuda_engine: $(OBJ)/tests/gpu/test_cuda_engine.o $(REF_OBJ) $(DAEMON_DEPS) $(BUILD)/lib/libmok.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_SAN) -o $@ $< $(REF_OBJ) $(BUILD)/lib/libmok.a $(DAEMON_LINK)

# the Hopper GEMM's device test and bench (run it on the GPU machine)
ifneq ($(HAVE_CUDA),)
GPU_TEST_BINS += $(BUILD)/tests/gpu/test_gemm_sm90
endif
$(BUILD)/tests/gpu/test_gemm_sm90: tests/gpu/test_gemm_sm90.cu tests/gpu/host_bf16_rng.h tests/harness/model_shapes.h \
		$(KLIB)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(KLIB) -lpthread -lm

# the ring's device test: macrobatches against one pass, bit for bit
ifneq ($(HAVE_CUDA),)
GPU_TEST_BINS += $(BUILD)/tests/gpu/test_ring
endif
$(BUILD)/tests/gpu/test_ring: tests/gpu/test_ring.cu tests/harness/cuda_check.cuh $(KLIB)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(KLIB) -lpthread -lm

# the kernels' own test (run_kernel_tests.sh builds it with ptxas reports too)
$(BUILD)/tests/gpu/test_kernels: tests/gpu/test_kernels.cu $(OBJ)/daemon/schedule.o \
		$(OBJ)/tests/gpu/sched_shim.o $(REF_OBJ) $(KLIB)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -o $@ $(filter-out %.a,$^) $(KLIB) -lpthread -lm

# the NCCL group against the kernels (NCCL is loaded at run time, never linked)
$(BUILD)/tests/gpu/test_nccl_group: tests/gpu/test_nccl_group.cu $(OBJ)/daemon/cuda/nccl.o \
		$(KLIB)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Idaemon -Itests/gpu -o $@ $< $(OBJ)/daemon/cuda/nccl.o \
		$(KLIB) -ldl -lpthread

# CUDA clients of libmok: the hostile tenant, the EP bench, the boundary
# benches (tests/gpu/build_device.sh links protobuf-c statically through PB_LIBS)
CUDA_CLIENT_FLAGS = $(NVCCFLAGS) -Iclient/include -Itests/gpu
# what the nvcc-built tests include (no dependency files for them)
GPU_TEST_HEADERS := $(wildcard tests/harness/*.h tests/gpu/*.h tests/gpu/*.cuh tests/bench/*.h)
$(BUILD)/tests/gpu/test_hostile: tests/gpu/test_hostile.cu $(BUILD)/lib/libmok.a $(GPU_TEST_HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) $(CUDA_CLIENT_FLAGS) -o $@ $< $(BUILD)/lib/libmok.a $(PB_LIBS) -ldl -lpthread
$(BUILD)/bench/bench_ep_cuda: tests/bench/bench_ep_cuda.cu $(BUILD)/lib/libmok.a \
		$(KLIB) $(GPU_TEST_HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) $(CUDA_CLIENT_FLAGS) -o $@ $< $(BUILD)/lib/libmok.a $(KLIB) \
		$(PB_LIBS) -ldl -lpthread
$(BUILD)/bench/bench_fence: tests/bench/bench_fence.cu $(BUILD)/lib/libmok.a $(GPU_TEST_HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) $(CUDA_CLIENT_FLAGS) -o $@ $< $(BUILD)/lib/libmok.a $(PB_LIBS) -lcuda -ldl -lpthread
# with the kernel library: --inproc-ab runs the same layer in-process next to mokd's
$(BUILD)/bench/mok_bench_daemon: tests/bench/mok_bench_daemon.cu $(BUILD)/lib/libmok.a \
		$(KLIB) $(GPU_TEST_HEADERS)
	@mkdir -p $(dir $@)
	$(NVCC) $(CUDA_CLIENT_FLAGS) -o $@ $< $(BUILD)/lib/libmok.a $(KLIB) \
		$(PB_LIBS) -lcuda -ldl -lpthread

GPU_CLIENT_BINS := $(BUILD)/tests/gpu/test_hostile $(BUILD)/bench/bench_ep_cuda \
	$(BUILD)/bench/bench_fence $(BUILD)/bench/mok_bench_daemon
# every GPU test program and bench (no GPU needed to build them)
gpu-tests: $(if $(HAVE_CUDA),gpu $(BUILD)/tests/gpu/test_cuda_engine $(BUILD)/tests/gpu/test_kernels \
		$(BUILD)/tests/gpu/test_nccl_group $(GPU_CLIENT_BINS))

gpu: $(if $(HAVE_CUDA),$(KLIB) $(GPU_TEST_BINS))
	@$(if $(HAVE_CUDA),echo "CUDA kernels built with $(NVCC)",echo "nvcc not found: CUDA parts skipped")

# ---- tests -----------------------------------------------------------------
test: all
	BUILD=$(BUILD) PYTHON=$(PYTHON) tests/run_tests.sh

# ---- fuzzing (clang + libFuzzer) ---------------------------------------------
# make fuzz [FUZZ_SECONDS=60]   each target for FUZZ_SECONDS (FUZZ_TARGETS=... to pick)
# make fuzz-smoke               each target for a few seconds (CI)
# One libFuzzer binary per parser, built from the production .c files
# (tests/fuzz/README.md). Needs clang and Debian's libclang-rt-14-dev.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 60
FUZZ_SMOKE_SECONDS ?= 5
FUZZ_TARGETS ?= request job_check config schedule http
FUZZ_CFLAGS := -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined \
	-fno-sanitize-recover=all -fno-omit-frame-pointer $(INCLUDES) -Itests/fuzz
FUZZ_SRC_request := tests/fuzz/fuzz_request.c proto/frame.c daemon/request.c daemon/layer.c \
	$(GEN)/mok.pb-c.c
FUZZ_SRC_job_check := tests/fuzz/fuzz_job_check.c daemon/job_check.c daemon/region.c \
	daemon/layer.c proto/mok_slots.c
FUZZ_SRC_config := tests/fuzz/fuzz_config.c daemon/config.c daemon/client_limits.c daemon/metrics_config.c \
	daemon/log.c
FUZZ_SRC_schedule := tests/fuzz/fuzz_schedule.c daemon/schedule.c
FUZZ_SRC_http := tests/fuzz/fuzz_http.c daemon/http.c
FUZZ_LIBS := $(PB_LIBS) $(SD_LIBS) -lm
FUZZ_BINS := $(addprefix $(BUILD)/fuzz/fuzz_,$(FUZZ_TARGETS))

define fuzz_rule
$(BUILD)/fuzz/fuzz_$(1): $(FUZZ_SRC_$(1)) $(GEN)/mok.pb-c.h $(wildcard tests/fuzz/*.h proto/*.h $(addsuffix /*.h,$(DAEMON_DIRS)))
	@mkdir -p $$(dir $$@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $$@ $(FUZZ_SRC_$(1)) $(FUZZ_LIBS)
endef
$(foreach t,request job_check config schedule http,$(eval $(call fuzz_rule,$(t))))

$(BUILD)/fuzz/gen_corpus: $(OBJ)/tests/fuzz/gen_corpus.o $(DAEMON_DEPS)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS_SAN) -o $@ $< $(DAEMON_LINK)

fuzz-check:
	@echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' | \
	  $(FUZZ_CC) -x c -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null || \
	  { echo "fuzz: $(FUZZ_CC) cannot build libFuzzer targets (apt-get install clang libclang-rt-14-dev)"; exit 1; }

fuzz-build: fuzz-check $(FUZZ_BINS) $(BUILD)/fuzz/gen_corpus
	@$(BUILD)/fuzz/gen_corpus $(BUILD)/fuzz/seeds

fuzz: fuzz-build
	tests/fuzz/run.sh $(BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-smoke: fuzz-build
	tests/fuzz/run.sh $(BUILD) $(FUZZ_SMOKE_SECONDS) $(FUZZ_TARGETS)

# ---- sanitizers: the whole test suite under ASan+UBSan, then under TSan ------
# (RSS may end further above its baseline there: freed memory sits in quarantine)
# (into $(BUILD)/asan and $(BUILD)/tsan: BUILD=build-x-san keeps them apart)
sanitize:
	MOK_RSS_SLACK_KIB=262144 $(MAKE) SAN=address,undefined BUILD=$(BUILD)/asan KBUILD=$(KBUILD) test
	MOK_RSS_SLACK_KIB=262144 $(MAKE) SAN=thread BUILD=$(BUILD)/tsan KBUILD=$(KBUILD) test

# ---- install -----------------------------------------------------------------
# make install [DESTDIR=/staging] [PREFIX=/usr/local]
VERSION := $(shell sed -n 's/^\#define MOK_VERSION "\(.*\)"/\1/p' proto/mok_version.h)
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCDIR ?= $(PREFIX)/include/mok
DOCDIR ?= $(PREFIX)/share/doc/mok
MANDIR ?= $(PREFIX)/share/man
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
SYSCONFDIR ?= /etc
MPS_CONTROL ?= /usr/bin/nvidia-cuda-mps-control
PYTHON_SITEDIR ?= $(if $(filter /usr,$(PREFIX)),/usr/lib/python3/dist-packages,$(PREFIX)/lib/$(shell $(PYTHON) -c 'import sys; print("python%d.%d" % sys.version_info[:2])' 2>/dev/null || echo python3)/dist-packages)
SUBST = sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@DOCDIR@|$(DOCDIR)|g' -e 's|@PREFIX@|$(PREFIX)|g' \
	-e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCDIR@|$(INCDIR)|g' -e 's|@VERSION@|$(VERSION)|g' \
	-e 's|@MPS_CONTROL@|$(MPS_CONTROL)|g'
D := $(DESTDIR)

install: $(BINS) $(LIBS)
	install -d $(D)$(BINDIR) $(D)$(LIBDIR)/pkgconfig $(D)$(INCDIR) $(D)$(DOCDIR) \
		$(D)$(UNITDIR)/mokd@.service.d $(D)$(SYSUSERSDIR) $(D)$(TMPFILESDIR) \
		$(D)$(SYSCONFDIR)/mok $(D)$(PYTHON_SITEDIR)/mok \
		$(D)$(MANDIR)/man1 $(D)$(MANDIR)/man5 $(D)$(MANDIR)/man8
	install -m 0755 $(BUILD)/bin/mokd $(BUILD)/bin/mokctl $(D)$(BINDIR)/
	install -m 0755 $(BUILD)/lib/libmok.so $(D)$(LIBDIR)/libmok.so.1
	ln -sf libmok.so.1 $(D)$(LIBDIR)/libmok.so
	install -m 0644 $(BUILD)/lib/libmok.a $(D)$(LIBDIR)/
	install -m 0644 client/include/mok.h proto/mok_enums.h proto/mok_status.h proto/mok_version.h \
		$(D)$(INCDIR)/
	$(SUBST) deploy/mok.pc.in > $(D)$(LIBDIR)/pkgconfig/mok.pc
	install -m 0644 client/python/mok/*.py client/python/mok/py.typed $(D)$(PYTHON_SITEDIR)/mok/
	$(MAKE) --no-print-directory units UNITS_OUT=$(D)$(UNITDIR)
	install -m 0644 deploy/systemd/mok-sysusers.conf $(D)$(SYSUSERSDIR)/mok.conf
	install -m 0644 deploy/systemd/mok-tmpfiles.conf $(D)$(TMPFILESDIR)/mok.conf
	install -m 0644 deploy/mokd.conf $(D)$(SYSCONFDIR)/mok/mokd.conf.example
	test -e $(D)$(SYSCONFDIR)/mok/mokd.conf || install -m 0644 deploy/mokd.conf $(D)$(SYSCONFDIR)/mok/mokd.conf
	install -m 0644 README.md LICENSE NOTICE docs/math.md docs/decisions.md $(D)$(DOCDIR)/
	for m in man1/mokctl.1 man5/mokd.conf.5 man8/mokd.8; do \
	  $(SUBST) docs/man/$${m#*/} > $(D)$(MANDIR)/$$m && chmod 0644 $(D)$(MANDIR)/$$m || exit 1; done
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ]; then ldconfig; \
	  command -v systemd-sysusers >/dev/null && systemd-sysusers $(SYSUSERSDIR)/mok.conf || true; \
	  command -v systemctl >/dev/null && systemctl daemon-reload 2>/dev/null || true; fi

# the systemd units with this build's paths filled in
UNITS_OUT ?= $(BUILD)/units
units:
	install -d $(UNITS_OUT)/mokd@.service.d
	$(SUBST) deploy/systemd/mokd@.service.in > $(UNITS_OUT)/mokd@.service
	$(SUBST) deploy/systemd/mokd@.socket.in > $(UNITS_OUT)/mokd@.socket
	$(SUBST) deploy/systemd/nvidia-mps.service.in > $(UNITS_OUT)/nvidia-mps.service
	install -m 0644 deploy/systemd/mok.target $(UNITS_OUT)/
	install -m 0644 deploy/systemd/mokd@.service.d/10-mps.conf $(UNITS_OUT)/mokd@.service.d/

uninstall:
	rm -f $(D)$(BINDIR)/mokd $(D)$(BINDIR)/mokctl $(D)$(LIBDIR)/libmok.so.1 $(D)$(LIBDIR)/libmok.so \
		$(D)$(LIBDIR)/libmok.a $(D)$(LIBDIR)/pkgconfig/mok.pc \
		$(D)$(UNITDIR)/mokd@.service $(D)$(UNITDIR)/mokd@.socket $(D)$(UNITDIR)/nvidia-mps.service \
		$(D)$(UNITDIR)/mok.target $(D)$(UNITDIR)/mokd@.service.d/10-mps.conf \
		$(D)$(SYSUSERSDIR)/mok.conf $(D)$(TMPFILESDIR)/mok.conf $(D)$(SYSCONFDIR)/mok/mokd.conf.example \
		$(D)$(MANDIR)/man1/mokctl.1 $(D)$(MANDIR)/man5/mokd.conf.5 $(D)$(MANDIR)/man8/mokd.8
	rm -rf $(D)$(INCDIR) $(D)$(DOCDIR) $(D)$(PYTHON_SITEDIR)/mok
	-rmdir $(D)$(UNITDIR)/mokd@.service.d 2>/dev/null
	@echo "uninstall: kept $(SYSCONFDIR)/mok/mokd.conf (your configuration)"

setup:
	deploy/setup.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
