package examplesvc

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
)

// Where says where a handler's reads of database db went, from the
// decision caughtup attached to ctx: the outcome, and "@replica" when a
// replica was chosen (e.g. "replica_waited@replica1", "primary").
func Where(ctx context.Context, db string) string {
	dec, _ := consume.DecisionFrom(ctx)
	where := dec.Outcome.String()
	if dd, ok := dec.Database(db); ok && dd.Replica != "" {
		where += "@" + dd.Replica
	}
	return where
}

// Counts formats counts as "key=n" pairs in key order, space-separated,
// so that two runs with the same counts print the same line.
func Counts[N int | int64](counts map[string]N) string {
	parts := make([]string, 0, len(counts))
	for k, n := range counts {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// CounterSums collects r and adds up the data points of the int64 counter
// name by the value of its attribute attr, formatted by Counts. Counters
// keep their sums after the instrumented object stops, so this reads what
// a consumer did once its Run has returned.
func CounterSums(ctx context.Context, r *sdkmetric.ManualReader, name, attr string) (string, error) {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(ctx, &rm); err != nil {
		return "", err
	}
	by := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if m.Name != name || !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				v, _ := dp.Attributes.Value(attribute.Key(attr))
				by[v.AsString()] += dp.Value
			}
		}
	}
	return Counts(by), nil
}

// Tally records what an example's handlers saw, for its summary: reads
// that missed their write (stale), where each read went (Where), and per
// key whether the messages ran in order. Safe for concurrent use; the zero
// value is ready.
type Tally struct {
	mu         sync.Mutex
	next       map[string]int // per key: how many leading messages ran
	where      map[string]int
	stale      int
	violations int
}

// Ran records a handler run for the message number seq (0, 1, ... in the
// order they were produced) of key, whose read of database db went where
// the decision in ctx says. A message that runs before an earlier one of
// its key is an order violation; one that runs again is not.
func (t *Tally) Ran(ctx context.Context, db, key string, seq int, stale bool) {
	where := Where(ctx, db)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.next == nil {
		t.next, t.where = map[string]int{}, map[string]int{}
	}
	t.where[where]++
	if stale {
		t.stale++
	}
	switch n := t.next[key]; {
	case seq == n:
		t.next[key] = n + 1
	case seq > n:
		t.violations++
	}
}

// Next is how many of key's leading messages (0 to Next-1) have run.
func (t *Tally) Next(key string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.next[key]
}

// Stale counts the reads that missed their message's write.
func (t *Tally) Stale() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stale
}

// Violations counts the messages that ran before an earlier one of their
// key.
func (t *Tally) Violations() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.violations
}

// Outcomes says where the reads went, formatted by Counts.
func (t *Tally) Outcomes() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return Counts(t.where)
}

// Await waits until done is closed (every message ran) or timeout passes
// (the summary then counts the missing ones as lost). It returns ctx's
// error if ctx ends first.
func Await(ctx context.Context, done <-chan struct{}, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
