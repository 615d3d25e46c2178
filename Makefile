.PHONY: setup test test-slow test-all lint typecheck serve demo-assets
VENV := .venv/bin

setup:            ## create .venv and install everything (idempotent)
	bash scripts/setup.sh

test:             ## fast + integration tests (the CI command)
	$(VENV)/python -m pytest -q

test-slow:        ## the slow tests too
	$(VENV)/python -m pytest -q -m "not gpu"

lint:             ## ruff on everything, mypy on the serving runtime
	$(VENV)/ruff check .
	$(VENV)/mypy

typecheck:        ## mypy on the serving runtime (python_backend/dspark/runtime + wiring.py)
	$(VENV)/mypy

serve:            ## Triton server on the default model (SmolLM2-135M-Instruct)
	$(VENV)/dspark serve

demo-assets:      ## rebuild corpus, tokenizer and demo target (about an hour on 2 cores)
	bash build/demo/build.sh
