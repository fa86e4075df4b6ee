# migdra — the two commands the README promises, plus their parts.
#   make demo   local cluster with simulated GPUs, workloads, MIG layout, teardown
#   make test   every test: unit, integration, fake CRI, chart, end-to-end

.PHONY: test demo build unit go-test chart-test e2e lint crds check-crds

build:
	cargo build --workspace --all-targets

unit: build
	cargo test --workspace --exclude migdra-e2e

go-test:
	cd e2e/upstream && GOFLAGS=-mod=mod go test ./cmd/fake-cri/...

chart-test:
	bash charts/tests/run.sh

e2e: build
	cargo test -p migdra-e2e --test e2e

test: unit go-test chart-test e2e

demo:
	cargo build --workspace --bins
	cargo run -p migdra-e2e --bin migdra-demo

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

# The chart's CRDs are generated from the Rust types; check-crds fails on drift.
crds:
	bash scripts/crds.sh write

check-crds:
	bash scripts/crds.sh check
