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
DAEMON_SRC := $(filter-out daemon/main.c daemon/engine_cuda.c,$(wildcard daemon/*.c))
CLIENT_SRC := $(wildcard client/src/*.c)
REF_SRC := $(wildcard tests/ref/*.c)
UNIT_SRC := $(wildcard tests/unit/test_*.c tests/integration/test_*.c)
BENCH_SRC := $(wildcard tests/bench/*.c)
KERNEL_SRC := $(wildcard kernels/*.cu)

ifneq ($(NVCC),)
  HAVE_CUDA := 1
  CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
  NVCCFLAGS ?= -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Ikernels -Iproto
  CUDA_DAEMON_SRC := daemon/engine_cuda.c
  CUDA_LIBS := -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib64/stubs -lcudart_static -lcuda -ldl -lrt
else
  HAVE_CUDA :=
endif

o = $(patsubst %.c,$(OBJ)/%.o,$(1))

WIRE_OBJ := $(call o,$(PROTO_SRC)) $(OBJ)/gen/mok.pb-c.o
DAEMON_OBJ := $(call o,$(DAEMON_SRC))
CLIENT_OBJ := $(call o,$(CLIENT_SRC))
REF_OBJ := $(call o,$(REF_SRC))

ifneq ($(HAVE_CUDA),)
  KERNEL_OBJ := $(patsubst %.cu,$(OBJ)/%.o,$(KERNEL_SRC))
  ifneq ($(wildcard $(CUDA_DAEMON_SRC)),)
    DAEMON_OBJ += $(call o,$(CUDA_DAEMON_SRC))
    CFLAGS += -DMOK_HAVE_CUDA=1 -I$(CUDA_HOME)/include
    DAEMON_LIBS_CUDA := $(BUILD)/lib/libmokkernels.a $(CUDA_LIBS)
  endif
endif

BINS := $(BUILD)/bin/mokd $(BUILD)/bin/mokctl
LIBS := $(BUILD)/lib/libmok.so $(BUILD)/lib/libmok.a
UNIT_BINS := $(addprefix $(BUILD)/tests/,$(basename $(notdir $(UNIT_SRC))))
BENCH_BINS := $(patsubst tests/bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

.PHONY: all debug test unit setup clean gpu bench
all: $(BINS) $(LIBS) $(UNIT_BINS) $(BENCH_BINS)

debug:
	$(MAKE) MODE=debug BUILD=build/debug all

# ---- generated protobuf code ----------------------------------------------
$(GEN)/mok.pb-c.c $(GEN)/mok.pb-c.h: proto/mok.proto
	@mkdir -p $(GEN)
	$(PROTOC_C) --proto_path=proto --c_out=$(GEN) proto/mok.proto

# every object may include the generated header
$(OBJ)/%.o: %.c $(GEN)/mok.pb-c.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(DEPFLAGS) -c $< -o $@

$(OBJ)/gen/mok.pb-c.o: $(GEN)/mok.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-error -c $< -o $@

$(OBJ)/kernels/%.o: kernels/%.cu $(wildcard kernels/*.h kernels/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# ---- libraries and programs -------------------------------------------------
$(BUILD)/lib/libmokwire.a: $(WIRE_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(BUILD)/lib/libmokd.a: $(DAEMON_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(BUILD)/lib/libmokkernels.a: $(KERNEL_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(BUILD)/lib/libmok.a: $(CLIENT_OBJ) $(WIRE_OBJ)
	@mkdir -p $(dir $@)
	$(AR) rcs $@ $^

$(BUILD)/lib/libmok.so: $(CLIENT_OBJ) $(WIRE_OBJ)
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libmok.so.1 $(LDFLAGS_SAN) -o $@ $^ $(PB_LIBS) $(LDLIBS)

DAEMON_DEPS := $(BUILD)/lib/libmokd.a $(BUILD)/lib/libmokwire.a $(if $(DAEMON_LIBS_CUDA),$(BUILD)/lib/libmokkernels.a)
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

gpu: $(if $(HAVE_CUDA),$(BUILD)/lib/libmokkernels.a)
	@$(if $(HAVE_CUDA),echo "CUDA kernels built with $(NVCC)",echo "nvcc not found: CUDA parts skipped")

# ---- tests -----------------------------------------------------------------
test: all
	BUILD=$(BUILD) PYTHON=$(PYTHON) tests/run_tests.sh

setup:
	deploy/setup.sh

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
