# The commands the README names. Each sets up the local virtual environment (.venv)
# on first use from the pinned requirements, so nothing is installed by hand.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
COURSE_STAMP := $(VENV)/.course-installed
DEV_STAMP := $(VENV)/.dev-installed
PYTEST_ARGS ?=

.PHONY: lab test test-fast lint checkpoints bench clean help grading-course test-class grading-time site test-site site-node test-busy \
	sandbox-tool

help:
	@echo "make lab          set up and open the course in JupyterLab"
	@echo "make test         set up and run every test (ruff, unit/property tests, notebooks)"
	@echo "make test-fast    ruff and the tests not marked slow (no notebooks, no browser): about 2 minutes"
	@echo "make checkpoints  retrain the shipped checkpoints in data/ (README's checkpoint table gives each one's time)"
	@echo "make bench        run every benchmark into data/bench/*.json and regenerate the README tables from them"
	@echo "make grading-course DIR=grading [CHAPTER=06]  lay out an nbgrader course folder (INSTRUCTORS.md)"
	@echo "make site         build the course as a static website (Jupyter Book 2; needs Node.js) into build/site/_build/html"
	@echo "make test-site    build the site if needed, then test it in Chromium (tests/test_site.py)"
	@echo "make test-class   a class on JupyterHub with nbgrader's exchange, end to end (tests/test_class.py; needs npm)"
	@echo "make test-busy    every notebook's student Run All beside a neighbour on every core (tests/test_busy_run_all.py)"
	@echo "make grading-time time autograde + the grading step per chapter into data/grading_time.json (~12 min)"

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
	$(BIN)/python -m ar_lab.course.grading.exercises release --out course
	JUPYTER_CONFIG_PATH=$(CURDIR)/course/.jupyter $(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) course/00_start_here.ipynb

lint: $(DEV_STAMP)
	$(BIN)/ruff check ar_lab tests notebooks

# Two processes (pytest-xdist; tests/conftest.py's scope: a notebook's cells, or a test file's tests, in one of
# them), then the tests that need the machine to themselves (tests/conftest.py: QUIET) alone.
test: sandbox-tool lint
	$(BIN)/python -m pytest tests notebooks --nbval-lax --nbval-current-env -m "not quiet" -n 2 --dist loadscope --durations=15 $(PYTEST_ARGS)
	$(BIN)/python -m pytest tests notebooks --nbval-lax --nbval-current-env -m quiet --durations=5 $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/python -m pytest tests -m "not slow" $(PYTEST_ARGS)

checkpoints: $(COURSE_STAMP)
	$(BIN)/python -m ar_lab.model.train --preset course --threads 2
	$(BIN)/python -m ar_lab.model.train --preset modern --threads 2
	$(BIN)/python -m ar_lab.model.train --preset draft --threads 2

bench: $(DEV_STAMP)
	$(BIN)/python -m ar_lab.bench decode --json data/bench/decode.json
	$(BIN)/python -m ar_lab.bench roofline --json data/bench/roofline.json
	$(BIN)/python -m ar_lab.bench batched --json data/bench/batched.json
	$(BIN)/python -m ar_lab.bench sampler --json data/bench/sampler.json
	$(BIN)/python -m ar_lab.bench constrained --json data/bench/constrained.json
	$(BIN)/python -m ar_lab.bench speculative --json data/bench/speculative.json
	$(BIN)/python -m ar_lab.bench selfspec --json data/bench/selfspec.json
	$(BIN)/python -m ar_lab.bench lookup --json data/bench/lookup.json
	$(BIN)/python -m ar_lab.bench serving --json data/bench/serving.json
	$(BIN)/python -m ar_lab.bench paged --json data/bench/paged.json
	$(BIN)/python -m ar_lab.bench quant --json data/bench/quant.json
	$(BIN)/python -m ar_lab.bench.readme

grading-course: sandbox-tool
	@test -n "$(DIR)" || { echo "usage: make grading-course DIR=folder [CHAPTER=06]"; exit 2; }
	@$(MAKE) --no-print-directory $(DEV_STAMP)
	$(BIN)/python -m ar_lab.course.grading.exercises course "$(DIR)" $(foreach c,$(CHAPTER),--chapter $(c))

# Grading runs learner code in a bubblewrap sandbox (ar_lab/course/grading/jail.py, INSTRUCTORS.md): Debian's bubblewrap,
# installed here when it is missing and apt-get can (as root, or with sudo without a password). Where it cannot,
# a warning: nbgrader autograde and the grading step then refuse to run learner code unless AR_LAB_SANDBOX=off.
sandbox-tool:
	@command -v bwrap >/dev/null 2>&1 || { \
		sudo=""; if [ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; fi; \
		command -v apt-get >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq bubblewrap >/dev/null \
		&& echo "installed bubblewrap: grading runs learner code in its sandbox"; } || \
		echo "WARNING: bubblewrap is not installed (apt-get install -y bubblewrap): grading refuses to run learner code without it, unless AR_LAB_SANDBOX=off"

# The JupyterHub class test: JupyterHub from requirements/class.txt, its proxy from the npm registry into
# .class-tools/ (git-ignored). Not part of `make test`; .ci/run runs it after.
CHP_VERSION := 5.3.0
CLASS_STAMP := $(VENV)/.class-installed
CHP_STAMP := .class-tools/.configurable-http-proxy-$(CHP_VERSION)

$(CLASS_STAMP): requirements/class.txt $(DEV_STAMP)
	$(BIN)/python -m pip install -r requirements/class.txt
	touch $@

$(CHP_STAMP):
	@command -v npm >/dev/null 2>&1 || { echo "make test-class needs Node.js 20+ with npm (the Hub's proxy, configurable-http-proxy, comes from the npm registry): install Node.js"; exit 1; }
	npm install --prefix .class-tools --no-fund --no-audit configurable-http-proxy@$(CHP_VERSION)
	touch $@

test-class: sandbox-tool $(CLASS_STAMP) $(CHP_STAMP)
	AR_LAB_CLASS_TEST=1 $(BIN)/python -m pytest tests/test_class.py $(PYTEST_ARGS)

# A learner's Run All of every notebook while a neighbour keeps every core busy (tests/test_busy_run_all.py).
# Not part of `make test`: the neighbour would slow its two processes past the budget.
test-busy: $(DEV_STAMP)
	$(BIN)/python -m pytest tests/test_busy_run_all.py -m busy -n 0 -rA --durations=5 $(PYTEST_ARGS)

# Seconds of nbgrader autograde + the grading step per submission, every chapter (INSTRUCTORS.md's table).
grading-time: sandbox-tool $(DEV_STAMP)
	$(BIN)/python -m ar_lab.course.grading.timing --no-once --parallel-chapter 05 --students 2 --processes 2 \
		--json data/grading_time.json --write INSTRUCTORS.md

# The static site (site/, Jupyter Book 2 from requirements/site.txt on the machine's Node.js): the student
# versions of the notebooks with their committed outputs, nothing executed. Not part of `make test`.
SITE_STAMP := $(VENV)/.site-installed
SITE_HTML := build/site/_build/html/index.html

site-node:
	@command -v node >/dev/null 2>&1 || { echo "make site needs Node.js 18, 20 or 22+ (node and npm): apt-get install nodejs npm, or https://nodejs.org"; exit 1; }

$(SITE_STAMP): requirements/site.txt $(COURSE_STAMP)
	$(BIN)/python -m pip install -r requirements/site.txt
	touch $@

site: site-node $(SITE_STAMP)
	$(BIN)/python site/build.py

$(SITE_HTML): $(wildcard notebooks/*.ipynb notebooks/*.md site/*.* site/theme/*) README.md | site-node $(SITE_STAMP)
	$(BIN)/python site/build.py

test-site: $(SITE_HTML) $(DEV_STAMP)
	$(BIN)/python -m pytest tests/test_site.py -m site $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
