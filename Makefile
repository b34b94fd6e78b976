# meshproof: the two-command quick start.
#   make demo   set up everything (packages, configure, build) and run scenarios/quickstart.yaml
#               (8 virtual ranks, HSDP x TP, MXFP8; golden + resume checks; reports in out/demo)
#   make test   set up everything and run the full CTest suite
#   make test-sanitize   the CPU suite (less `long`, `library`, `sweep`) under ASan+UBSan in build-asan (clang)
#   make fuzz   the libFuzzer targets: regression replay, then FUZZ_SECONDS each from the seeds
BUILD_DIR ?= build
BUILD_TYPE ?= Release
MESHPROOF_CUDA ?= AUTO
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# Unity builds (docs/design.md section 17): up to 8 sources of a target per compiler run, in both
# builds; a third less build time. UNITY=OFF configures one source per run (each source then has
# to include all it uses, and an edit recompiles one file, not its batch). Read at configure time:
# an existing build folder keeps the choice it was configured with.
UNITY ?= ON
# The sanitizer + fuzz build (docs/design.md section 17): clang, ASan+UBSan (+ libFuzzer coverage),
# -O1 as ASan recommends, line tables for the reports' stacks.
ASAN_DIR ?= build-asan
FUZZ_SECONDS ?= 60
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1 \
  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp:print_suppressions=0 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: all deps configure build test test-cpu test-gpu test-sanitize sanitize-build fuzz demo \
  format format-check gpu-bundle clean

all: build

deps:
	./tools/setup-deps.sh

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DMESHPROOF_CUDA=$(MESHPROOF_CUDA) -DCMAKE_UNITY_BUILD=$(UNITY) $(CMAKE_FLAGS)

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DMESHPROOF_CUDA=$(MESHPROOF_CUDA) -DCMAKE_UNITY_BUILD=$(UNITY) $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

test-cpu: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) -L cpu

test-gpu: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L gpu

$(ASAN_DIR)/build.ninja: | deps
	cmake -S . -B $(ASAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
	  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" \
	  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" \
	  -DMESHPROOF_CUDA=OFF -DMESHPROOF_SANITIZE=ON -DMESHPROOF_FUZZ=ON -DMESHPROOF_WERROR=OFF \
	  -DCMAKE_UNITY_BUILD=$(UNITY) $(CMAKE_FLAGS)

# gtest_discover_tests runs each test binary at build time, so the build needs the options too.
sanitize-build: deps $(ASAN_DIR)/build.ninja
	$(SANITIZE_ENV) cmake --build $(ASAN_DIR) -j $(JOBS)

test-sanitize: sanitize-build
	$(SANITIZE_ENV) ctest --test-dir $(ASAN_DIR) --output-on-failure -j $(JOBS) -L cpu -LE 'long|library|sweep'

fuzz: deps $(ASAN_DIR)/build.ninja
	$(SANITIZE_ENV) cmake --build $(ASAN_DIR) -j $(JOBS) \
	  --target scenario_loader_fuzz checkpoint_index_fuzz dcp_metadata_fuzz
	$(SANITIZE_ENV) tests/fuzz/run-fuzz $(ASAN_DIR) $(FUZZ_SECONDS)

demo: build
	$(BUILD_DIR)/harness/meshproof run scenarios/quickstart.yaml --backend cpu --out out/demo

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

format-check:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

gpu-bundle: build
	./tools/gpu-bundle $(BUILD_DIR) bundle

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) bundle
