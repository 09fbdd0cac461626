# The two commands of the quick start, and their helpers. Everything runs in a virtual environment
# (.venv, created on first use) so nothing touches the system Python.
#
#   make test    unit tests + every notebook under pytest --nbmake (executed copies in _executed/);
#                make test JOBS=0 runs its first part in this one process, with no xdist workers
#   make book    the Jupyter Book, notebooks executed (reusing make test's results when current),
#                written to _build/html/index.html: the student edition, exercises without solutions
#   make book-instructor   the same with the worked solutions (book/solutions/), in _build/instructor/
#
# Variables: PYTHON (the interpreter that creates the venv, >= 3.10), TORCH (the torch requirement
# installed first when the venv has no torch; e.g. TORCH="torch --index-url <your CPU wheel index>").

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
INSTALLED := $(VENV)/.minimoe-installed

.PHONY: install test unit notebooks book book-instructor check-book sync benchmark reference-study clean

# pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set (as on our CI machines),
# nothing compiled later is saved, and every interpreter would compile torch again (--no-compile
# saved 54 s of install and cost more than that in the tests).
$(INSTALLED): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "minimoe needs Python >= 3.10, found " + sys.version.split()[0]'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[all]"
	@touch $(INSTALLED)

install: $(INSTALLED)

# make test runs in two parts, and runs both even when the first fails (its exit status is the
# first failure's). First the unit tests and the notebooks whose figures and claims rest on no
# measured time, on every core at once: pytest-xdist, JOBS worker processes of one torch thread each
# (two threads per worker on two cores made the unit tests no faster), a test file's tests on one
# worker. The s/run columns of notebooks 02, 04, 07 and 09 are then measured on shared cores. Then,
# alone and on the usual thread count, the notebooks whose figures or claims compare measured times,
# so that nothing else shares the cores while they measure.
JOBS ?= auto
TIMED_NOTEBOOKS := 01-moe-layer-from-scratch 03b-sinkhorn-numerics 05b-six-routers-trained \
	10b-ksubset-numerics-and-pseudocode 11b-probmoe-training 12-expert-parallelism-on-a-laptop
TIMED := $(TIMED_NOTEBOOKS:%=_executed/%.ipynb)
ONE_THREAD := $(if $(filter 0,$(JOBS)),,OMP_NUM_THREADS=1)

test: install
	$(PY) book/_scripts/stage.py notebooks
	status=0; \
	$(ONE_THREAD) $(PY) -m pytest tests _executed --nbmake --overwrite --nbmake-timeout=600 \
		-n $(JOBS) --dist loadfile $(TIMED:%=--ignore=%) || status=$$?; \
	$(PY) -m pytest $(TIMED) --nbmake --overwrite --nbmake-timeout=600 \
		|| { code=$$?; [ $$status -ne 0 ] || status=$$code; }; \
	exit $$status

unit: install
	$(PY) -m pytest tests

book: install
	$(PY) book/_scripts/stage.py book
	$(VENV)/bin/jupyter-book build _build/src --path-output . -W --keep-going
	@echo "The book: _build/html/index.html"

# the instructor edition: the same book with the worked solutions of book/solutions/ (not in `make book`)
book-instructor: install
	$(PY) book/_scripts/stage.py book-instructor
	$(VENV)/bin/jupyter-book build _build/src --path-output _build/instructor -W --keep-going
	@echo "The instructor edition: _build/instructor/_build/html/index.html"

check-book: install
	MINIMOE_REQUIRE_BOOK=1 $(PY) -m pytest tests/test_rendered_book.py

sync: install
	$(VENV)/bin/jupytext --sync notebooks/*.py

benchmark: install
	$(PY) -m benchmarks

# The reference study of chapter 9 (about 6 CPU-hours: two worker processes of one thread each).
# Resumable: the same command continues an interrupted study. The clustered task, whose runs are the
# cheapest, gets 24 seeds (chapter 9, "How finely the study resolves", says why).
REFERENCE := $(PY) -m minimoe.experiments run --routers all,ssr_p0,softmax_topk_dropless,baselines --scale reference \
	--workers 2 --threads 1 --no-progress --out minimoe/experiments/results/reference-cpu
reference-study: install
	$(REFERENCE) --task all --seeds 8
	$(REFERENCE) --task clustered --seeds 24

clean:
	rm -rf _build _executed
