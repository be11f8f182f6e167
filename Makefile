# The two commands of the README: `make demo` and `make test`.
# Both set up .venv on first use (scripts/install.sh), so a fresh clone needs nothing else.
VENV ?= .venv
STAMP := $(VENV)/.kvxferd-installed

.PHONY: setup demo test lint

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) ./scripts/install.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvxferd demo

# pytest exits 5 when it collects nothing; make treats any non-zero exit as failure.
test: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests benchmarks
	$(VENV)/bin/ruff format --check kvxferd tests benchmarks
	$(VENV)/bin/mypy
