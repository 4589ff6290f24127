# The README's commands. `make quickstart` and `make test` install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser quickstart test test-slow lint bench

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, pinned: on these machines pip takes the local CPU wheel for exactly 2.13.0
	$(PY) -m pip install -q torch==2.13.0
	# then every other package at the version the README was measured with (constraints.txt)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/marlow quickstart --out marlow-quickstart

# The report's browser test (tests/e2e/test_report_browser.py) drives Debian's Chromium through
# its driver; install both when either is missing (root, or sudo). Lists are refreshed only when
# the install fails without them. Grouped target (&:): the recipe runs once for both files.
CHROMIUM := /usr/bin/chromium /usr/bin/chromedriver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver

$(CHROMIUM) &:
	$(APT_INSTALL) || ($(SUDO) apt-get update -q && $(APT_INSTALL))

browser: $(CHROMIUM)

test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

bench: $(STAMP)
	$(PY) bench/step_cost.py
