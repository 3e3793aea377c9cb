package caughtupriver

import (
	"context"
	"fmt"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of the instruments this package
// creates. Routing decisions themselves are counted by the consume
// package (caughtup.consume.decisions).
const ScopeName = "github.com/caughtup/caughtup/river/caughtupriver"

// tokenSource names where a job's token came from, as the
// caughtup.river.token attribute of caughtup.river.tokens.
type tokenSource uint8

const (
	// tokenMetadata: the token in the job's metadata, alone.
	tokenMetadata tokenSource = iota
	// tokenFetch: the primary's position read after the job was fetched.
	tokenFetch
	// tokenMetadataFetch: both merged, for a unique job (its metadata
	// token does not cover the inserts River skipped as duplicates).
	tokenMetadataFetch
	// tokenMalformed: metadata that does not decode; the job reads the
	// primary (consume.ReasonMalformedToken).
	tokenMalformed
	// tokenNone: no metadata token, and Config.UnstampedReadPrimary; the
	// job reads the primary (consume.ReasonNoToken).
	tokenNone
	// tokenFetchFailed: the primary's position could not be read; the job
	// reads the primary.
	tokenFetchFailed
	// tokenPrimaryPolicy: consume.Always, which needs no token.
	tokenPrimaryPolicy
	// tokenSnoozed: the position read for the job's fetch before its last
	// snooze, kept in its metadata (snoozedToken): no read.
	tokenSnoozed
	// tokenEarlierRead: a position read before the fetch, after a scan of
	// River's table that showed the job committed (visibleJobs): no read.
	tokenEarlierRead

	numTokenSources = int(tokenEarlierRead) + 1
)

var tokenSourceNames = [numTokenSources]string{
	tokenMetadata:      "metadata",
	tokenFetch:         "fetch",
	tokenMetadataFetch: "metadata_fetch",
	tokenMalformed:     "malformed",
	tokenNone:          "none",
	tokenFetchFailed:   "fetch_failed",
	tokenPrimaryPolicy: "always",
	tokenSnoozed:       "snoozed",
	tokenEarlierRead:   "earlier_read",
}

func (s tokenSource) String() string {
	if int(s) < len(tokenSourceNames) {
		return tokenSourceNames[s]
	}
	return "token(" + strconv.Itoa(int(s)) + ")"
}

const (
	attrToken    = "caughtup.river.token"
	attrOverride = "caughtup.river.override"
	attrResult   = "caughtup.result"
)

// metrics are synchronous instruments whose attribute sets are built once,
// so that counts survive the client's shutdown and two middlewares on one
// MeterProvider add to the same series.
type metrics struct {
	tokens      metric.Int64Counter
	tokenSets   [numTokenSources]metric.AddOption
	reads       metric.Int64Counter
	readOK      metric.AddOption
	readFailed  metric.AddOption
	overrides   metric.Int64Counter
	lastAttempt metric.AddOption
	// replicaFailed: snoozed after replica failures.
	replicaFailed metric.AddOption
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	meter := mp.Meter(ScopeName)
	system := semconv.MessagingSystemKey.String("river")
	m := &metrics{}
	var err error
	if m.tokens, err = meter.Int64Counter("caughtup.river.tokens",
		metric.WithUnit("{job}"),
		metric.WithDescription("River jobs routed, by where their token came from: metadata, fetch (the primary's position read after the fetch), metadata_fetch (unique jobs), snoozed (the position read before the job's last snooze), earlier_read (a position read after a scan that showed the job committed), malformed, none, fetch_failed (the last three read the primary), always.")); err != nil {
		return nil, fmt.Errorf("caughtup/river: creating caughtup.river.tokens: %w", err)
	}
	for s := range tokenSource(numTokenSources) {
		m.tokenSets[s] = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrToken, s.String())))
	}
	if m.reads, err = meter.Int64Counter("caughtup.river.position.reads",
		metric.WithUnit("{query}"),
		metric.WithDescription("Reads of the primary's WAL position made to stamp fetched River jobs; one read serves every job that was waiting for it.")); err != nil {
		return nil, fmt.Errorf("caughtup/river: creating caughtup.river.position.reads: %w", err)
	}
	m.readOK = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrResult, "ok")))
	m.readFailed = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrResult, "failed")))
	if m.overrides, err = meter.Int64Counter("caughtup.river.overrides",
		metric.WithUnit("{job}"),
		metric.WithDescription("River jobs whose routing the middleware limited so that River would not discard them (last_attempt: held in the worker rather than refused by the fallback cap; replica_failed: snoozed after replicas failed the worker consume.MaxReroutes times in a row, rather than failing an attempt).")); err != nil {
		return nil, fmt.Errorf("caughtup/river: creating caughtup.river.overrides: %w", err)
	}
	m.lastAttempt = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrOverride, "last_attempt")))
	m.replicaFailed = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrOverride, "replica_failed")))
	return m, nil
}

func (m *metrics) token(ctx context.Context, s tokenSource) { m.tokens.Add(ctx, 1, m.tokenSets[s]) }

func (m *metrics) read(ctx context.Context, err error) {
	if err != nil {
		m.reads.Add(ctx, 1, m.readFailed)
		return
	}
	m.reads.Add(ctx, 1, m.readOK)
}
