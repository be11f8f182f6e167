# The two commands of the README: `make demo` and `make test`.
# Both set up .venv on first use (scripts/install.sh), so a fresh clone needs nothing else.
VENV ?= .venv
STAMP := $(VENV)/.kvxferd-installed

.PHONY: setup demo demo-vllm test lint

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) ./scripts/install.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvxferd demo

# vLLM prefill and decode instances exchanging KV through two daemons (issue 12); sets up
# .venv-vllm on first use (scripts/install-vllm.sh, ~1.5 min with a warm cache).
demo-vllm: $(STAMP)
	./scripts/install-vllm.sh
	$(VENV)/bin/python -m kvxferd.integrations.vllm.demo

# pytest exits 5 when it collects nothing; make treats any non-zero exit as failure.
# scripts/test-deps.sh installs promtool and systemd-analyze if missing (apt-get;
# never fatal: the tests that need them then skip and say why).
# scripts/install-vllm.sh sets up .venv-vllm (vLLM on CPU, its own venv) for the vLLM
# integration tests (tests/integrations); a no-op when it is there already.
# compileall: the suite starts hundreds of daemon and engine processes, and where
# PYTHONDONTWRITEBYTECODE is set (these hosts set it) each one compiled kvxferd's sources
# again (~0.2 s of CPU a process, about an eighth of the daemon tests' time).
# scripts/run-tests.sh: pytest on two workers, then the host-wide tests alone.
test: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests benchmarks
	$(VENV)/bin/mypy
	./scripts/test-deps.sh
	./scripts/container-deps.sh
	./scripts/install-vllm.sh
	$(VENV)/bin/python -m compileall -q kvxferd tests >/dev/null
	VENV=$(VENV) ./scripts/run-tests.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests benchmarks
	$(VENV)/bin/ruff format --check kvxferd tests benchmarks
	$(VENV)/bin/mypy
