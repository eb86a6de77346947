# `make demo` sets up .venv and runs a local 4-node mesh; `make test` sets up .venv and runs the
# checks CI runs. Either works first. On a machine with a GPU, pick the torch build you need:
#   make demo TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint bench-transport bench-membership bench-stragglers bench-fuzz gpu-check image-check clean

venv: $(VENV)/.installed

# Bytecode is written once, in parallel, after the installs: with PYTHONDONTWRITEBYTECODE set (as
# in CI) no process writes it, and every process that imports torch would compile it again (~7 s
# of CPU where reading the bytecode takes ~3). A few files written for newer Pythons (torch's
# py312_intrinsics) do not compile and are never imported: their errors are not the install's.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --no-compile -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

demo: venv
	$(BIN)/gossipmesh mesh

# Two workers: mesh tests wait (pauses, partitions, fixed run times) as much as they compute; on
# the 2-core CI kind the suite took 668 s against 959 s on one (pytest alone runs on one). Three
# took as long (468 s against 456): the tests are CPU-bound then. Tests run in the files' order,
# which spreads the meshes between the short tests (run first, the meshes all fell to one worker).
test: venv lint
	$(BIN)/python -m pytest -n 2

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench-transport: venv
	$(BIN)/python bench/transport.py

bench-membership: venv
	$(BIN)/python bench/membership.py

bench-stragglers: venv
	$(BIN)/python bench/stragglers.py

# On a machine with an NVIDIA GPU: make gpu-check TORCH_SPEC="torch --index-url ..."
gpu-check: venv
	$(BIN)/python -m pip install --quiet -e ".[gpu]"
	$(BIN)/python bench/gpu_check.py
	$(BIN)/python bench/gpu_codec.py

# Builds the image and runs meshes of its containers in docker, or podman (bench/image_check.py,
# through tests/test_image.py: not part of make test). On a machine that
# ../shared/containers/setup.sh prepared (podman in a sandbox, no image pulled): its flags, its
# base image, and torch from the wheel folder pip is pointed at (PIP_FIND_LINKS)
CONTAINER_SETUP := $(abspath $(wildcard ../shared/containers/setup.sh))
IMAGE_CHECK_ARGS ?= $(if $(CONTAINER_SETUP),--setup $(CONTAINER_SETUP) \
	--build-arg PYTHON_IMAGE=localhost/py311-debian \
	$(if $(PIP_FIND_LINKS),--build-arg "TORCH_SOURCE=--find-links $(PIP_FIND_LINKS)"))

image-check: venv
	$(BIN)/python -m pip install --quiet -e ".[containers]"
	GOSSIPMESH_IMAGE_CHECK='$(IMAGE_CHECK_ARGS)' $(BIN)/python -m pytest -m container -s tests/test_image.py

bench-fuzz: venv
	$(BIN)/python bench/fuzz_wire.py --seconds 600

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
