# caughtup — every target works on a fresh machine once .ci/run (or the
# README's requirements) installed PostgreSQL 15 and redis-server.

GO        ?= go
FUZZTIME  ?= 30s
# -p 2: integration packages each start their own PostgreSQL cluster; two at
# a time fits a 2-core machine.
TESTFLAGS ?= -race -count=1 -p 2 -timeout 12m

.PHONY: all build vet test unit fuzz bench demo chaos chaos-short clean

all: test

build:
	$(GO) build ./...

vet:
	$(GO) vet ./...

# All tests, including the integration tests on a real primary with
# streaming replicas and a real redis-server, then a bounded fuzz run.
test: build vet
	$(GO) test $(TESTFLAGS) ./...
	$(MAKE) fuzz FUZZTIME=$(FUZZTIME)

unit:
	$(GO) test -count=1 -short ./position/...

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./position/
	$(GO) test -run '^$$' -fuzz '^FuzzParseDebezium$$' -fuzztime 10s ./outbox/

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./position/ ./consume/

demo:
	$(GO) run ./cmd/caughtup demo

chaos:
	$(GO) run ./chaos

chaos-short:
	$(GO) run ./chaos -short
