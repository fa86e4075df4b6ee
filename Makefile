# migdra — the two commands the README promises, plus their parts.
#   make demo   local cluster on containerd with simulated GPUs, migdra from its chart (helm
#               install, images from a loopback registry), workloads, MIG layout, teardown
#   make test   every test: unit, integration, fake CRI, chart, end-to-end (on containerd, migdra
#               from its chart)
#   make lint   formatting and lints: Rust, the Go in e2e/upstream, shell scripts
#   make fault-campaign TRIALS=1000 [SEED=1] [JOBS=8]
#               the kubelet plugin's randomized fault campaign in benchmark mode (a table of
#               faults injected and invariant violations; not part of `make test`, whose
#               plugin tests run a bounded campaign)
#   make bench  performance at cluster scale: one table, B1–B7 (not part of `make test`)
#   make images migdra's images from the Dockerfile, built without a Docker daemon (OCI tarballs)
#
# `make test` compiles each crate once: `build` compiles every target of the workspace, and
# `unit` and `e2e` only run what it built. That needs them to resolve the same features: cargo
# unifies dependency features over the packages a command selects, so `cargo test -p
# migdra-e2e` would build tokio, hyper, tower, kube, migdra-api, migdra-runtime, the fake NVML
# and the e2e crate a second time with other features (and each switch between selections
# re-links the fake NVML and the e2e crate). Hence `--workspace --test e2e`. `--exclude
# migdra-e2e` resolves the same features as the whole workspace, because every feature the e2e
# crate turns on is also turned on by another member.

.PHONY: test demo bench images build unit go-test chart-test e2e lint lint-rust lint-go lint-shell crds check-crds fault-campaign

build:
	cargo build --workspace --all-targets

unit: build
	cargo test --workspace --exclude migdra-e2e

go-test:
	cd e2e/upstream && GOFLAGS=-mod=mod go test ./cmd/fake-cri/...

chart-test:
	bash charts/tests/run.sh

# The e2e suite, on a cluster whose kubelet runs on containerd and runc built from the Go module
# proxy (e2e/runtime/), with migdra installed by its Helm chart and running only in its pods,
# from images built from the Dockerfile (e2e/runtime/migdra-images.sh, with the binaries `build`
# made). One theme: `make e2e E2E_FILTER=day2` (one filter, a theme or a test name).
E2E_FILTER ?=
e2e: build
	cargo test --workspace --test e2e -- $(E2E_FILTER)

test: unit go-test chart-test e2e

# The Dockerfile's images plus the e2e workload probe, built without a Docker daemon
# (e2e/runtime/migdra-images.sh; prints the directory holding images.txt and the tarballs).
images:
	bash e2e/runtime/migdra-images.sh

# The demo runs the binary `build`'s feature set made: `cargo run -p migdra-e2e` would resolve
# other features and recompile the fake NVML and the e2e crate each time (see above).
DEMO_BIN = $${CARGO_TARGET_DIR:-target}/debug
demo:
	cargo build --workspace --bins
	$(DEMO_BIN)/migdra-demo

# The benchmark runs release builds of migdra (controller, plugin, fake NVML) and of the bench,
# which also runs the packing simulation (B7); flags come from BENCH_* variables, e.g. `make bench BENCH_NODES=2000`
# (see `migdra-bench --help`). Takes about 20 minutes with the defaults on 2 cores.
BENCH_BIN = $${CARGO_TARGET_DIR:-target}/release
bench:
	cargo build --release -p migdra-controller -p migdra-kubelet-plugin -p migdra-fake-nvml -p migdra-bench
	$(BENCH_BIN)/migdra-bench

lint: lint-rust lint-go lint-shell

lint-rust:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

# go vet covers the fake CRI, the module's only package; tools/ (behind the `tools` build tag)
# and etcd/ (a module of its own) only pin the upstream builds.
lint-go:
	@cd e2e/upstream && unformatted=$$(gofmt -l .) && \
	  if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted" >&2; exit 1; fi
	cd e2e/upstream && GOFLAGS=-mod=mod go vet ./...

lint-shell:
	shellcheck $$(git ls-files '*.sh') .ci/run

# The chart's CRDs are generated from the Rust types; check-crds fails on drift.
crds:
	bash scripts/crds.sh write

check-crds:
	bash scripts/crds.sh check

# The campaign's time goes mostly into the fake NVML's JSON state file, so the fake is built
# optimized (a small crate); the campaign itself runs as a debug example.
TRIALS ?= 1000
SEED ?= 1
JOBS ?= 8
CAMPAIGN_TARGET = $${CARGO_TARGET_DIR:-target}
fault-campaign:
	cargo build --release -p migdra-fake-nvml
	cargo build -p migdra-kubelet-plugin --example fault_campaign
	MIGDRA_FAKE_NVML_LIB="$$(realpath $(CAMPAIGN_TARGET)/release/libmigdra_fake_nvml.so)" \
	  $(CAMPAIGN_TARGET)/debug/examples/fault_campaign --trials $(TRIALS) --seed $(SEED) --jobs $(JOBS)
