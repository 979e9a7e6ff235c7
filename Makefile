# Two commands: `make run` (everything, offline once installed) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench install clean

# Installs only when pyproject.toml changed since the last install, so later runs work offline.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python -m ragline.run

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) *.egg-info
