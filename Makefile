# Tessera: `make demo` sets up .venv and runs the demo; `make test` sets up .venv and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint chromium

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) manage.py demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run

# Browser tests drive Debian's Chromium (never a downloaded browser). Installed here when missing and
# we are root with apt-get; otherwise those tests skip and say why.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

test: lint chromium
	$(VENV)/bin/pytest $(PYTEST_ARGS)
