# ncclwatch: top-level entry points (README: `make setup`, `make test`).
SHELL := /bin/bash
PY    := .venv/bin/python

.PHONY: setup test lint pytest plugin-test services-start services-stop services-status

setup:
	scripts/setup.sh

# The full test command (what .ci/run runs after setup).
test: lint plugin-test pytest

lint:
	$(PY) -m ruff check .

plugin-test:
	@if [ -f plugin/Makefile ]; then $(MAKE) -C plugin test; else echo "plugin/Makefile absent: no C tests"; fi

# Extra pytest arguments: make test PYTEST_ARGS='-k kafka -x'. pytest's own exit code is
# written to $NCCLWATCH_PYTEST_RC_FILE when set (.ci/run uses it to tell exit 5, "no tests").
pytest:
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ -n "$$NCCLWATCH_PYTEST_RC_FILE" ]; then echo $$rc > "$$NCCLWATCH_PYTEST_RC_FILE"; fi; \
	exit $$rc

services-start:
	scripts/services.sh start all

services-stop:
	scripts/services.sh stop all

services-status:
	scripts/services.sh status all
