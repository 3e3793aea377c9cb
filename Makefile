# caughtup. `make test` and `make demo` work on a fresh Debian machine:
# they install what is missing first (as root, or with password-less
# sudo): make demo only the PostgreSQL server and redis-server (deps-demo),
# make test everything its harnesses start (deps).

GO        ?= go
# Fuzz budgets are execution counts, not durations: at a duration's end
# Go 1.26's fuzzing coordinator can race its own deadline and fail with
# "context deadline exceeded" and no failing input (go.dev/issue/75804,
# fixed in Go 1.27). These take about 30 s, 10 s, 10 s and 15 s on 2 cores.
FUZZ_POSITION ?= 500000x
FUZZ_CDC      ?= 70000x
FUZZ_FEED     ?= 130000x
FUZZ_SESSION  ?= 200000x
# -p 2: integration packages each start their own PostgreSQL cluster; two at
# a time fits a 2-core machine.
TESTFLAGS ?= -race -count=1 -p 2 -timeout 12m
CHAOSFLAGS ?=
# The PostgreSQL release every real-cluster test runs (testkit/pgtest),
# handed to the tests as CAUGHTUP_PG_VERSION: empty (the default) is
# Debian's 15; 15, 16, 17 or 18 (16 and later come from Maven Central, once,
# into the download cache), e.g. make test-core PG_VERSION=18.
PG_VERSION ?= $(CAUGHTUP_PG_VERSION)
export CAUGHTUP_PG_VERSION := $(PG_VERSION)
# The core packages that run on real clusters, those of them that exist.
CORE_PKGS := $(foreach d,internal/pgwal enqueue consume replay cdc outbox testkit/pgtest,$(if $(wildcard $(d)/*.go),./$(d)))

.PHONY: all deps deps-demo build vet test test-core fuzz bench demo chaos chaos-short fleet go-floor doccheck

all: test

# Installs the PostgreSQL server, redis-server, HAProxy, PgBouncer, the
# network tools, promtool, Java 17 and Maven when they are missing, and
# resolves the Kafka harness's jars (testkit/kafkatest).
deps:
	@scripts/install-deps

# Installs only what make demo runs: the PostgreSQL server and
# redis-server (the demo's Kafka broker is franz-go's in-process kfake).
deps-demo:
	@scripts/install-deps --demo

# The core's tests on real clusters only, quick enough to run once per
# PostgreSQL release: for v in 15 16 17 18; do make test-core PG_VERSION=$$v; done
test-core: deps
	$(GO) test $(TESTFLAGS) $(CORE_PKGS)

build:
	$(GO) build ./...

# Builds with the toolchain go.mod's go directive names (downloaded once),
# to check that the directive is as low as the code allows.
go-floor:
	GOTOOLCHAIN=go$$(sed -n 's/^go //p' go.mod) $(GO) build ./...

vet:
	$(GO) vet ./...

# All tests, including the integration tests on a real primary with
# streaming replicas, a real redis-server, Apache Kafka broker and Kafka
# Connect with Debezium, then a bounded fuzz run.
test: deps build vet
	$(GO) test $(TESTFLAGS) ./...
	$(MAKE) fuzz

# Compiles every Go snippet of the documentation (README.md, docs/, the
# packages' doc comments) against the module; make test runs it too, as
# part of go test ./... (internal/doccheck).
doccheck:
	$(GO) test -count=1 -run '^TestDocs$$' ./internal/doccheck/

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZ_POSITION) ./position/
	$(GO) test -run '^$$' -fuzz '^FuzzParseDebezium$$' -fuzztime $(FUZZ_CDC) ./cdc/
	$(GO) test -run '^$$' -fuzz '^FuzzParseMessage$$' -fuzztime $(FUZZ_FEED) ./feed/
	$(GO) test -run '^$$' -fuzz '^FuzzOpen$$' -fuzztime $(FUZZ_SESSION) ./web/caughtuphttp/

# Benchmarks, including the throughput runs that print tables (kafka:
# routed vs plain kafka-go consumer); never part of make test.
bench:
	$(GO) test -run '^$$' -bench . -benchmem ./position/ ./consume/ ./replay/ ./outbox/ ./feed/ ./asynq/... ./river/... ./web/...
	$(GO) test -run '^$$' -bench . -benchmem -timeout 30m ./kafka/...

demo: deps-demo
	$(GO) run ./cmd/caughtup-demo

# The fault scenarios on real PostgreSQL, Redis and Kafka (chaos/internal/lab);
# KAFKA_BROKERS=host:port,... uses an existing Kafka cluster instead of the
# broker the suite starts. CHAOSFLAGS='-run diverged -v' runs a subset.
chaos: deps
	$(GO) run ./chaos $(CHAOSFLAGS)

chaos-short: deps
	$(GO) run ./chaos -short $(CHAOSFLAGS)

# The fleet simulation (chaos/fleet): N routers on the
# position feed or polling by themselves against the real cluster and
# Redis; prints a table. Not part of make chaos: it loads the machine for
# minutes. FLEETFLAGS='-feed 10,100 -local ""' runs some rows.
FLEETFLAGS ?=
fleet: deps
	$(GO) run ./chaos/fleet $(FLEETFLAGS)

# One program under examples/ on the demo's cluster (a primary with two
# streaming replicas and redis-server, plus a Kafka broker, and Kafka
# Connect with Debezium, for the examples that need them), replay paused at
# random for up to EXAMPLE_MAX_PAUSE at a time:
#   make example EXAMPLE=kafka-consumer EXAMPLE_ARGS='-messages 1000'
# make examples runs them all, one after another (kafka-consumer with each
# Kafka client).
EXAMPLE           ?= asynq-worker
EXAMPLE_ARGS      ?=
EXAMPLE_MAX_PAUSE ?= 1s
EXAMPLES          := asynq-worker river-worker kafka-consumer outbox-relay debezium-consumer web-session
example_services   = $(if $(filter debezium-consumer,$(1)),-debezium,$(if $(filter kafka-consumer outbox-relay,$(1)),-kafka))

.PHONY: example examples
example: $(if $(call example_services,$(EXAMPLE)),deps,deps-demo)
	$(GO) run ./cmd/caughtup-demo cluster $(call example_services,$(EXAMPLE)) -max-pause $(EXAMPLE_MAX_PAUSE) -- $(GO) run ./examples/$(EXAMPLE) $(EXAMPLE_ARGS)

examples: deps
	@set -e; for e in $(EXAMPLES); do $(MAKE) --no-print-directory example EXAMPLE=$$e; done
	@$(MAKE) --no-print-directory example EXAMPLE=kafka-consumer EXAMPLE_ARGS='-client franz-go'

