# Two commands: `make demo` (the proxy in front of real local vLLM CPU ranks)
# and `make test`. Both create .venv on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ftproxy-installed

.PHONY: setup demo test lint unit e2e bench bench-held bench-instructions soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py proxy/dataplane/_events.c proxy/upstream/_framing.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,test,otel]'
	@# PyPI torchvision/torchaudio break `import vllm` beside the CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(PY) -m rig.demo

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest -m "not e2e"

e2e: setup
	$(PY) -m pytest -m e2e

test: lint
	$(PY) -m pytest

bench-held: setup
	flock /tmp/ftproxy-heavy.lock $(PY) -m bench.held --streams $(or $(STREAMS),9000) \
		--workers $(or $(WORKERS),1)

# Instructions per stream event and per small request under callgrind: the same
# count whatever else the machine does (~8 minutes a version; needs valgrind).
bench-instructions: setup
	$(PY) -m bench.instructions $(if $(BEFORE),--versions $(BEFORE))

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.relay $(if $(BEFORE),--versions $(BEFORE))
	$(PY) -m bench.floors
	$(PY) -m bench.accesslog
	$(PY) -m bench.held
	$(PY) -m bench.workers

# Real-engine soak: 20 injected faults per mode (abort, resume), every answer
# checked against a fault-free oracle; prints the table (about 25 minutes).
soak: setup
	$(PY) -m bench.soak --faults $(or $(FAULTS),20)

clean:
	rm -rf $(VENV) .rig
