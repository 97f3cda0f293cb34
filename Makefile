# `make test` and `make install` create .venv when it is missing. torch is installed first and
# pinned: an unpinned torch would pull the multi-GB CUDA build.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test translate bleu clean

MODEL_DIR ?= data/models/bench-de-en
SPLIT ?= 1
# BLOCK_SIZE, BETA, TAU, MAX_DRAFT_BATCH, VERIFY, SEED and the sampling rules' TEMPERATURE,
# SAMPLING_TOPK, SAMPLING_TOPP: decoding settings, passed on when set (defaults:
# spec_nmt/settings.py)
SETTINGS = $(if $(BLOCK_SIZE),--block-size $(BLOCK_SIZE)) $(if $(BETA),--beta $(BETA)) $(if $(TAU),--tau $(TAU)) \
  $(if $(MAX_DRAFT_BATCH),--max-draft-batch $(MAX_DRAFT_BATCH)) \
  $(if $(VERIFY),--verify $(VERIFY)) $(if $(SEED),--seed $(SEED)) \
  $(if $(TEMPERATURE),--temperature $(TEMPERATURE)) \
  $(if $(SAMPLING_TOPK),--sampling-topk $(SAMPLING_TOPK)) $(if $(SAMPLING_TOPP),--sampling-topp $(SAMPLING_TOPP))
# DRAFTER: what drafts (twin, file, none; default auto: spec-nmt-translate --drafter)
DRAFTER_FLAG = $(if $(DRAFTER),--drafter $(DRAFTER))
# THREADS: torch's CPU threads (spec-nmt-translate --threads; default and why: spec_nmt/runtime.py)
THREADS_OF = from spec_nmt.runtime import DEFAULT_THREADS; print(DEFAULT_THREADS)
# fairseq-interactive gets the same output length limit as the API (fairseq's own is 0/200)
LENGTH_FLAGS = from spec_nmt.settings import DEFAULTS; print(*DEFAULTS.fairseq_flags(['max_len_a', 'max_len_b']))

# spec_nmt_torch_load writes its .pth into site-packages, which lets stock fairseq tools load
# checkpoints with torch >= 2.6 (an editable install cannot carry that file itself).
$(STAMP): setup.py requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt -r requirements-test.txt
	$(PIP) install -q --no-deps -e .
	$(PY) -m spec_nmt_torch_load
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=20 tests

# Translate German with speculative decoding on CPU: from INPUT=file, else from stdin; at a
# terminal, each typed line as soon as it is typed (Ctrl-D ends), as spec-nmt-translate does
# (INPUT=data/examples.de translates the examples). Prints one English line per input line;
# lines of several sentences are split and joined again (SPLIT=0: one line = one sentence), files
# are decoded in batches (BATCH_SIZE sentences, default spec-nmt-translate's) with a progress bar.
# THREADS=N lets torch use N CPU threads (spec-nmt-translate --threads, which says why its default).
# STATS=1 adds spec-nmt-translate --stats (whether drafting ran, accepted drafts per iteration).
# FAIRSEQ_OUTPUT=1 runs fairseq-interactive instead (one line = one sentence) and shows its
# S-/H-/D-/P- output and logs. Like SPLIT, these switches read 0, no and false as off.
translate: $(STAMP)
	@for f in verifier.pt drafter.pt dict.de.txt dict.en.txt spm.model; do \
	  test -f $(MODEL_DIR)/$$f || { echo "make translate: $(MODEL_DIR)/$$f is missing (set MODEL_DIR to a model pair, see README)" >&2; exit 1; }; \
	done
ifneq ($(filter-out 0 no false,$(FAIRSEQ_OUTPUT)),)
	@if [ -n "$(INPUT)" ]; then cat "$(INPUT)"; else cat; fi | \
	OMP_NUM_THREADS=$(or $(THREADS),$$($(PY) -c "$(THREADS_OF)")) \
	PYTHONWARNINGS=ignore $(VENV)/bin/fairseq-interactive $(MODEL_DIR) --user-dir spec_nmt --task spec_translation \
	  --source-lang de --target-lang en --path $(MODEL_DIR)/verifier.pt \
	  --drafter-path $(MODEL_DIR)/drafter.pt $(DRAFTER_FLAG) $(SETTINGS) $$($(PY) -c "$(LENGTH_FLAGS)") \
	  --bpe sentencepiece --sentencepiece-model $(MODEL_DIR)/spm.model --cpu
else
	@PYTHONWARNINGS=ignore $(VENV)/bin/spec-nmt-translate '$(MODEL_DIR)' --cpu \
	  $(SETTINGS) $(DRAFTER_FLAG) $(if $(BATCH_SIZE),--batch-size $(BATCH_SIZE)) \
	  $(if $(THREADS),--threads $(THREADS)) \
	  $(if $(filter 0 no false,$(SPLIT)),--no-split-sentences) \
	  $(if $(filter-out 0 no false,$(STATS)),--stats) \
	  --input $(if $(INPUT),'$(subst ','\'',$(INPUT))',-)
endif

# Score SRC (raw German) against REF (raw English) with MODEL_DIR, through the plugin and through
# stock fairseq-generate --beam 1, which must agree (scripts/bleu.py says how); without SRC and
# REF, newstest2014 as sacreBLEU downloads it. WORK_DIR keeps the data-bin and the outputs.
bleu: $(STAMP)
	@$(PY) scripts/bleu.py --model-dir '$(MODEL_DIR)' $(if $(SRC),--src '$(SRC)') \
	  $(if $(REF),--ref '$(REF)') $(if $(WORK_DIR),--work-dir '$(WORK_DIR)')

clean:
	rm -rf $(VENV) *.egg-info
