# meshproof: the two-command quick start.
#   make demo   set up everything (packages, configure, build) and run scenarios/quickstart.yaml
#               (8 virtual ranks, HSDP x TP, MXFP8; golden + resume checks; reports in out/demo)
#   make test   set up everything and run the full CTest suite
BUILD_DIR ?= build
BUILD_TYPE ?= Release
MESHPROOF_CUDA ?= AUTO
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test test-cpu test-gpu demo format format-check gpu-bundle clean

all: build

deps:
	./tools/setup-deps.sh

$(BUILD_DIR)/build.ninja: | deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DMESHPROOF_CUDA=$(MESHPROOF_CUDA) $(CMAKE_FLAGS)

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DMESHPROOF_CUDA=$(MESHPROOF_CUDA) $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

test-cpu: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) -L cpu

test-gpu: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L gpu

demo: build
	$(BUILD_DIR)/harness/meshproof run scenarios/quickstart.yaml --backend cpu --out out/demo

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

format-check:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror

gpu-bundle: build
	./tools/gpu-bundle $(BUILD_DIR) bundle

clean:
	rm -rf $(BUILD_DIR) bundle
