# mgpu — see README.md. Every target is documented there.
GO          ?= go
BUILD       := $(CURDIR)/build
CACHE_DIR   ?= /var/cache/mgpu
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT      ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
GO_LDFLAGS  := -X github.com/mgpu-dev/mgpu/internal/version.Version=$(VERSION) \
               -X github.com/mgpu-dev/mgpu/internal/version.Commit=$(COMMIT)
# urfave/cli without its man-page and markdown generators (none of our
# commands uses them): their init (blackfriday's tables) cost every hook run
# about 3 ms of the time a container start waits for.
GO_TAGS     := urfave_cli_no_docs
# go-nvml's cgo prologue declares deprecated NVML calls; keep builds quiet.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
export PATH := $(CACHE_DIR)/bin:$(PATH)

# C components, each with its own Makefile (BUILD= is passed down).
C_DIRS := $(patsubst %/Makefile,%,$(wildcard test/fakecuda/Makefile test/workload/Makefile enforcer/shim/Makefile))

.PHONY: all build go c test fuzz deps lint e2e bench demo package image clean

all: build

build: go c

# mgpu-hook is built without cgo (the second line): a dynamically linked
# binary loads libc and starts cgo's threads before main, about 3 ms of
# every container start; the hook needs neither.
CGO_CMDS := $(filter-out ./cmd/mgpu-hook/,$(sort $(dir $(wildcard ./cmd/*/main.go))))
go:
	$(GO) build -tags $(GO_TAGS) -ldflags "$(GO_LDFLAGS)" -o $(BUILD)/bin/ $(CGO_CMDS)
	CGO_ENABLED=0 $(GO) build -tags $(GO_TAGS) -ldflags "$(GO_LDFLAGS)" -o $(BUILD)/bin/ ./cmd/mgpu-hook
	$(GO) build -o $(BUILD)/bin/mgpu-demo ./test/demo
	$(GO) build -o $(BUILD)/bin/mgpu-bench ./test/bench

c:
	@set -e; for d in $(C_DIRS); do $(MAKE) --no-print-directory -C $$d BUILD=$(BUILD); done

# deps installs what the tests need (idempotent; apt packages need root).
deps:
	@scripts/deps.sh

# Share measurements (test/process, test/e2e, test/packaging, which runs
# the container suite on the installed package, and test/k8s, a real
# single-node cluster) run one package at a time
# after the rest: two of them at once on a 2-core machine measure each other.
SERIAL_PKGS := ./test/process ./test/tenants ./test/e2e ./test/packaging ./test/k8s

test: deps build
	$(GO) test -race -timeout 30m $$($(GO) list ./... | grep -v -e '/test/process$$' -e '/test/tenants$$' -e '/test/e2e$$' -e '/test/packaging$$' -e '/test/k8s$$')
	$(MAKE) --no-print-directory fuzz
	$(GO) test -p 1 -count=1 -timeout 40m $(SERIAL_PKGS)

# fuzz: every Fuzz function in the repository, FUZZTIME each beyond its
# seed corpus (scripts/fuzz.sh says how); 29 fuzzers at 5 s are about 5
# minutes on 2 cores, most of it building the instrumented binaries.
FUZZTIME ?= 5s
fuzz:
	@GO=$(GO) scripts/fuzz.sh $(FUZZTIME)

lint: deps
	$(GO) vet ./...
	golangci-lint run ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1; }

# demo: the main job on the simulated node (policies side by side, live).
demo: build
	$(BUILD)/bin/mgpu-demo

# bench: BENCH lines and a table, every comparison measured side by side.
bench: build
	$(BUILD)/bin/mgpu-bench $(BENCH_FLAGS)

# e2e: the container tests (test/e2e; root, runc, containerd 2.x, podman:
# test/e2e/deps.sh installs them; see docs/e2e.md).
e2e: build
	$(GO) test -count=1 -timeout 20m ./test/e2e/...

clean:
	rm -rf $(BUILD)

# package: build/dist/mgpu_<version>_<arch>.deb and mgpu-<version>-1.<arch>.rpm
# with nfpm (installed into $(CACHE_DIR)/bin when missing). PKG_VERSION comes
# from VERSION (git describe) through packaging/scripts/pkg-version.sh;
# `make package VERSION=0.0.2` builds that version.
NFPM_VERSION ?= v2.48.0
NFPM         := $(CACHE_DIR)/bin/nfpm
PKG_VERSION  ?= $(shell packaging/scripts/pkg-version.sh "$(VERSION)")
PKG_ARCH     ?= $(shell $(GO) env GOARCH)
DIST         := $(BUILD)/dist

package: build
	@test -x $(NFPM) || { echo "package: installing nfpm $(NFPM_VERSION) into $(CACHE_DIR)/bin"; \
	  mkdir -p $(CACHE_DIR)/bin && cd /tmp && GOBIN=$(CACHE_DIR)/bin GOFLAGS=-buildvcs=false \
	  $(GO) install github.com/goreleaser/nfpm/v2/cmd/nfpm@$(NFPM_VERSION); }
	@test -n "$(PKG_VERSION)" || { echo "package: no package version (see packaging/scripts/pkg-version.sh)"; exit 1; }
	packaging/scripts/stage.sh $(BUILD) $(BUILD)/pkg
	mkdir -p $(DIST)
	@set -e; for p in deb rpm; do \
	  (cd $(BUILD)/pkg && MGPU_PKG_VERSION=$(PKG_VERSION) MGPU_PKG_ARCH=$(PKG_ARCH) \
	    $(NFPM) package --config $(CURDIR)/packaging/nfpm.yaml --packager $$p --target $(DIST)/); \
	done

# image: $(DIST)/mgpu-image_<version>_<arch>.tar, mgpu's container image
# (every binary, the shim, the default config; the cgo binaries with the C
# library they load) as an OCI archive, written by packaging/image with no
# registry and no container daemon; the same build gives the same digest.
# Named $(IMAGE_REPO):<version, '+' and '~' turned into '-'>.
IMAGE_REPO ?= ghcr.io/mgpu-dev/mgpu
IMAGE_OUT  ?= $(DIST)/mgpu-image_$(PKG_VERSION)_$(PKG_ARCH).tar

image: build
	@test -n "$(PKG_VERSION)" || { echo "image: no version (see packaging/scripts/pkg-version.sh)"; exit 1; }
	$(GO) run ./packaging/image -build $(BUILD) -version "$(PKG_VERSION)" -repository $(IMAGE_REPO) -out $(IMAGE_OUT)
