# Krypton — all set-up goes through these targets; a fresh clone needs only `make run`
# or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.requirements-installed
HOST   ?= 127.0.0.1
PORT   ?= 8050

.PHONY: node setup test test-load test-busy test-quick test-gpu gpu-wheels lint run serve worker cluster bench bench-load bench-dropin bench-serve bench-hostile bench-gpu bench-methods controls analyze models tune calibrate clean pacs viewer ohif harder

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .  # the `krypton` command
	touch $(STAMP)

setup: $(STAMP)

# Two pytest-xdist workers, one torch thread each (tests/conftest.py): the team tests
# share one Redis-and-Celery cluster and run in one group on one worker; everything else
# spreads over both. The tests marked underload (what the page shows: prediction and
# picture bound at the click, cached re-runs, Compare streaming, the team cluster) run
# beside TEST_BURNERS CPU-burning processes (default 2, one per core; tests/conftest.py's
# busy_host), as a user's browser, video call or test suite would be: they assert what is
# visible, never how fast this host is, so one pass beside the burners covers them.
# --durations: the ten slowest tests (pytest prints the wall time), to keep the suite short.
TEST_BURNERS ?= 2
test: $(STAMP)
	KRYPTON_TEST_BURNERS=$(TEST_BURNERS) $(PY) -m pytest -q -n 2 --dist loadgroup --durations=10

# Only the underload tests, beside two burners (the part of make test that checks what
# the page shows on a busy machine).
test-load: $(STAMP)
	KRYPTON_TEST_BURNERS=$(TEST_BURNERS) $(PY) -m pytest -q -m underload --durations=5

# make test's whole suite beside BURNERS CPU burners (default 4: load ~6 on 2 cores),
# ROUNDS times (default 1); each round's status, minutes and load average are printed.
test-busy: $(STAMP)
	$(PY) -m bench.beside --burners $(or $(BURNERS),4) --rounds $(or $(ROUNDS),1) -- \
		$(PY) -m pytest -q -n 2 --dist loadgroup --durations=10

# The quick loop: everything but the browser, security and team suites (real servers).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not browser and not security and not team"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

run: $(STAMP)
	$(PY) app.py --host $(HOST) --port $(PORT)

# Production entry for anything beyond localhost: Debian's nginx in front (per-address
# connection cap, header and body timeouts; webapp/front.py) of waitress, one process with
# threads (jobs, models and the queue live in the process). KRYPTON_FRONT=none serves
# waitress alone, for a front of your own. Set
# KRYPTON_USERNAME/KRYPTON_PASSWORD or KRYPTON_AUTH_HEADER and KRYPTON_ALLOWED_HOSTS first
# (docs/security.md).
serve: $(STAMP)
	$(PY) app.py --production --host $(HOST) --port $(PORT)

# Team mode: one Celery worker for the app started with KRYPTON_BROKER_URL set
# (docs/team.md). Pool and thread choices are explained in webapp/worker.py.
WORKER_NAME ?= worker
worker: $(STAMP)
	@test -n "$$KRYPTON_BROKER_URL" || { echo "set KRYPTON_BROKER_URL=redis://HOST:PORT/DB"; exit 2; }
	$(PY) -m webapp.cluster --worker $(WORKER_NAME)

# The whole team deployment on this machine: redis-server, 2 workers and the app.
PACS_PORT ?= 8042
NODE_PORT ?= 11112
REDIS_PORT ?= 6390
cluster: $(STAMP)
	$(PY) -m webapp.cluster --host $(HOST) --port $(PORT) --redis-port $(REDIS_PORT) --workers 2

# A PACS to try Krypton with (docs/usage.md, "From a PACS"): Debian's Orthanc with its
# DICOMweb plugin on a local port, its storage in cache/pacs, the chest-CT sample stored
pacs: $(STAMP)
	$(PY) -m demo.pacs --folder cache/pacs --port $(PACS_PORT) --route-to $(NODE_PORT)

# Krypton as an AI node beside `make pacs`: a DICOM Storage SCP (AE KRYPTON, port
# NODE_PORT) that explains each series routed to it and stores the result in its study.
# The PACS sends with its AE title in NODE_CALLERS; see docs/usage.md (AI node).
NODE_CALLERS ?= ORTHANC
node: $(STAMP)
	KRYPTON_DICOMWEB_URL=$${KRYPTON_DICOMWEB_URL:-http://$(HOST):$(PACS_PORT)/dicom-web} \
	KRYPTON_DICOMWEB_USER=$${KRYPTON_DICOMWEB_USER:-krypton} \
	KRYPTON_DICOMWEB_PASSWORD=$${KRYPTON_DICOMWEB_PASSWORD:-krypton-demo} \
	$(PY) -m krypton node --port $(NODE_PORT) --allow $(NODE_CALLERS)

# The viewer sites put beside Orthanc: OHIF v3 (npm @ohif/app's prebuilt dist/, fetched
# once into cache/ohif by `make ohif`) served by Debian's nginx on one origin with the
# PACS of `make pacs`, whose sign-in nginx adds (demo/viewer.py). Open the printed address,
# then a study, and double-click Krypton's PMAP series to overlay it.
VIEWER_PORT ?= 8043
viewer: ohif
	$(PY) -m demo.viewer --port $(VIEWER_PORT) --pacs http://$(HOST):$(PACS_PORT)/dicom-web

ohif: $(STAMP)
	$(PY) -c "from demo.viewer import fetch_ohif; print(fetch_ohif())"

bench: $(STAMP)
	$(PY) -m bench.bench
	$(PY) -m bench.default_model
	$(PY) -m bench.architectures --on-off
	$(PY) -m bench.op_count --memory vgg16
	$(PY) -m bench.profile
	$(PY) -m bench.reuse
	$(PY) -m bench.volumes
	$(PY) -m bench.volume_demo
	$(PY) -m bench.clinical_ct
	$(PY) -m bench.approximate
	$(PY) -m bench.gated
	$(PY) -W ignore -m bench.dropin
	$(PY) -W ignore -m bench.integrated_gradients
	$(PY) -m bench.estimates
	$(PY) -m bench.time_left --burners 0
	$(PY) -m bench.time_left --burners 2
	$(PY) -m bench.run_path
	$(PY) -m bench.speed_claims
	$(PY) -m bench.speed_claims --burners 2
	$(PY) -m bench.speed_claims --burners 2 --exact-only 6
	$(PY) -W ignore -m bench.busy_host
	$(PY) -W ignore -m bench.schedule_matrix
	$(MAKE) bench-methods

# The method comparison's no-fill controls (demo/controls.py; out/controls/, kept once
# trained), then the comparison on the shipped models and the controls, with the model's
# fill and the input's mean; the tables go into docs/models.md and README.md. First the
# model-free maps against chance on today's generators and the harder ones (no model).
controls: $(STAMP)
	$(PY) -m demo.controls

# The demo recipe on the harder generator (look-alikes on every eye): fundus-hard-demo,
# into out/harder (kept once trained; 1.5-5 h on 2 idle cores, by the host; a stopped run
# resumes from out/progress/).
harder: $(STAMP)
	test -f out/harder/fundus-hard-demo.json || $(PY) -m demo.fundus.train train --task fundus-hard-demo

bench-methods: controls harder
	$(PY) -m bench.conspicuity
	$(PY) -W ignore -m bench.methods --controls out/controls --doc docs/models.md --readme README.md

# On a CUDA host: the GPU matrix (fp32 and bf16; bench/gpu.py, under 6 minutes on one
# H100/H200) and the cuda-marked tests. They use the host's own Python and PyTorch
# (GPU_PYTHON), not .venv: a GPU machine brings its own CUDA build of PyTorch.
GPU_PYTHON ?= python3
# The 13 nets in fp32 and the bf16 rows the targets name: about 7 minutes on one H200,
# inside one 10-minute call (the whole matrix in bf16 too, at three rounds, is not).
bench-gpu:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m bench.gpu --precisions fp32
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m bench.gpu --precisions bf16 \
		--nets vgg16,resnet18

# What a card's own Python 3.12 lacks for make test-gpu (the app's stack, Captum, MONAI),
# at this venv's versions, as wheels in .whl: carry .whl to the card and install them with
# pip --no-index --target DIR, then PYTHONPATH=DIR make test-gpu.
GPU_WHEELS = dash diskcache flask itsdangerous blinker janus plotly pydantic pydantic_core \
	annotated-types typing-inspection captum monai retrying nest-asyncio
gpu-wheels: $(STAMP)
	mkdir -p .whl
	for name in $(GPU_WHEELS); do \
		version=$$($(PY) -m pip show $$name | sed -n 's/^Version: //p'); \
		$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
			--implementation cp --platform manylinux_2_28_x86_64 \
			--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
			-d .whl "$$name==$$version" || exit 1; \
	done

# The files that hold cuda-marked tests: a card's host need not have the browser, DICOM or
# team stacks that the other test files import.
test-gpu:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest -q -o addopts="" -p no:cacheprovider -m cuda \
		$$(grep -l "mark.cuda" tests/test_*.py)

# Captum's Occlusion and MONAI's OcclusionSensitivity against Krypton's drop-ins.
bench-dropin: $(STAMP)
	$(PY) -W ignore -m bench.dropin
	$(PY) -W ignore -m bench.integrated_gradients

# Team mode with 1 and 2 workers: positions/s for 1, 4, 16 sessions, light-request
# latency under load, batch throughput (local only, bounded).
bench-serve: $(STAMP)
	$(PY) -m bench.serve

# 16 sessions + 3 abandoned jobs against a local server, then the hostile mix: 8 sessions
# among the 12 hostile requests on make serve's server (loopback only, bounded).
bench-load: $(STAMP)
	$(PY) -m bench.load
	$(PY) -m bench.load --hostile --sessions 8

# Every hostile volume against make serve's server (nginx front, basic auth) and krypton
# explain: RSS growth and time each; eight of the worst at once beside another user; 2,000
# slow sockets from one address (loopback only, bounded). Needs nginx (.ci/run installs it).
bench-hostile: $(STAMP)
	$(PY) -m bench.hostile_volumes_bench

analyze: $(STAMP)
	for model in vgg16 resnet18 inception_v3 fundus-demo; do \
		$(VENV)/bin/krypton analyze --model $$model | tail -1; done

# Fetch ImageNet weights through torchvision's weights API (needs network access).
models: $(STAMP)
	$(PY) -c "import torchvision as tv; [tv.models.get_model(n, weights='DEFAULT') for n in ('resnet18', 'vgg16', 'inception_v3')]"

# Fit the demo model's SSIM(tau) curve and this host's runtime estimator (krypton/shipped_models/*.json).
tune: $(STAMP)
	$(VENV)/bin/krypton tune --model fundus-demo --stride 8

calibrate: $(STAMP)
	$(VENV)/bin/krypton calibrate --model fundus-demo

clean:
	rm -rf $(VENV) out cache .pytest_cache
