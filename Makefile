# Tessera: `make demo` sets up .venv and runs the demo; `make test` sets up .venv and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint chromium serving-deps alerting-deps pdf-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP) pdf-deps
	$(PY) manage.py demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run
	$(VENV)/bin/mypy
	$(PY) tests/deadcode.py

# Browser tests drive Debian's Chromium (never a downloaded browser). Installed here when missing and
# we are root with apt-get; otherwise those tests skip and say why.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

# The alerting tests start Debian's Prometheus and Alertmanager on loopback (and promtool checks the rules). Installed
# here when missing and we are root with apt-get (the daemons the packages start are stopped: the tests run their
# own on free ports); otherwise those tests skip and say why.
alerting-deps:
	@if { ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; } \
	    && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's prometheus and prometheus-alertmanager for the alerting tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null; \
	  for s in prometheus prometheus-alertmanager prometheus-node-exporter; do service $$s stop >/dev/null 2>&1 || true; done; fi

# The slice sandbox (per-slice Unix users, namespaces, firewall rules, cgroups) and its tests need, as root:
# bubblewrap, iproute2, nftables, util-linux (setpriv, prlimit), libseccomp2, and a Python other users can run,
# with numpy (Debian's python3 + python3-numpy). Installed here when missing and we are root with apt-get.
SANDBOX_TOOLS := bwrap ip nft setpriv prlimit
serving-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { ! /usr/bin/python3 -c 'import numpy' 2>/dev/null \
	    || ! ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1 \
	    || ! (for t in $(SANDBOX_TOOLS); do command -v $$t >/dev/null || exit 1; done); }; then \
	  echo "installing Debian's bubblewrap, nftables, iproute2, util-linux, libseccomp2, python3-numpy for the sandbox"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap nftables iproute2 \
	    util-linux libseccomp2 python3 python3-numpy >/dev/null; fi

# Invoice and credit-note PDFs (WeasyPrint) lay text out with Debian's pango and its fonts: DejaVu installed here
# when missing and we are root with apt-get; otherwise the PDF links say why there is no PDF and those tests skip.
pdf-deps:
	@if { [ ! -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || ! ls /usr/lib/*/libpango-1.0.so.0 >/dev/null 2>&1; } \
	    && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's fonts-dejavu-core and pango for the invoice PDFs"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core libpango-1.0-0 \
	    libpangoft2-1.0-0 >/dev/null; fi

test: lint chromium serving-deps alerting-deps pdf-deps
	$(VENV)/bin/pytest $(PYTEST_ARGS)
