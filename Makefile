# The commands the README names. Each sets up the local virtual environment (.venv)
# on first use from the pinned requirements, so nothing is installed by hand.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
COURSE_STAMP := $(VENV)/.course-installed
DEV_STAMP := $(VENV)/.dev-installed
PYTEST_ARGS ?=

.PHONY: lab test test-fast lint checkpoints bench clean help grading-course

help:
	@echo "make lab          set up and open the course in JupyterLab"
	@echo "make test         set up and run every test (ruff, unit/property tests, notebooks)"
	@echo "make test-fast    ruff and the tests not marked slow (no notebooks, no browser): under 2 minutes"
	@echo "make checkpoints  retrain the shipped checkpoints in data/ (under an hour on 2 cores)"
	@echo "make bench        run every benchmark into data/bench/*.json and regenerate the README tables from them"
	@echo "make grading-course DIR=grading [CHAPTER=06]  lay out an nbgrader course folder (INSTRUCTORS.md)"

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ar_lab needs Python 3.11 or newer (the version CI tests)")'
	$(PYTHON) -m venv $(VENV)

$(COURSE_STAMP): requirements/course.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -r requirements/course.txt
	$(BIN)/python -m pip install --no-deps -e .
	touch $@

$(DEV_STAMP): requirements/dev.txt $(COURSE_STAMP)
	$(BIN)/python -m pip install -r requirements/dev.txt
	touch $@

lab: $(COURSE_STAMP)
	$(BIN)/python -m ar_lab.course.exercises release --out course
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) course/00_start_here.ipynb

lint: $(DEV_STAMP)
	$(BIN)/ruff check ar_lab tests notebooks

# Two processes (pytest-xdist; tests/conftest.py's scope: a notebook's cells, or a test file's tests, in one of
# them), then the tests that need the machine to themselves (tests/conftest.py: QUIET) alone.
test: lint
	$(BIN)/python -m pytest tests notebooks --nbval-lax --nbval-current-env -m "not quiet" -n 2 --dist loadscope $(PYTEST_ARGS)
	$(BIN)/python -m pytest tests notebooks --nbval-lax --nbval-current-env -m quiet $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/python -m pytest tests -m "not slow" $(PYTEST_ARGS)

checkpoints: $(COURSE_STAMP)
	$(BIN)/python -m ar_lab.model.train --preset course --threads 2
	$(BIN)/python -m ar_lab.model.train --preset draft --threads 2

bench: $(DEV_STAMP)
	$(BIN)/python -m ar_lab.bench decode --json data/bench/decode.json
	$(BIN)/python -m ar_lab.bench roofline --json data/bench/roofline.json
	$(BIN)/python -m ar_lab.bench sampler --json data/bench/sampler.json
	$(BIN)/python -m ar_lab.bench constrained --json data/bench/constrained.json
	$(BIN)/python -m ar_lab.bench speculative --json data/bench/speculative.json
	$(BIN)/python -m ar_lab.bench selfspec --json data/bench/selfspec.json
	$(BIN)/python -m ar_lab.bench lookup --json data/bench/lookup.json
	$(BIN)/python -m ar_lab.bench serving --json data/bench/serving.json
	$(BIN)/python -m ar_lab.bench paged --json data/bench/paged.json
	$(BIN)/python -m ar_lab.bench quant --json data/bench/quant.json
	$(BIN)/python -m ar_lab.bench.readme

grading-course:
	@test -n "$(DIR)" || { echo "usage: make grading-course DIR=folder [CHAPTER=06]"; exit 2; }
	@$(MAKE) --no-print-directory $(DEV_STAMP)
	$(BIN)/python -m ar_lab.course.exercises course "$(DIR)" $(foreach c,$(CHAPTER),--chapter $(c))

clean:
	rm -rf $(VENV)
