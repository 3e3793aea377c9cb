package kafkasuite

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caughtup/caughtup/consume"
)

// Ledger checks what handlers saw: every record's row read fresh from the
// pool the router chose, per-key order under at-least-once (the n-th
// record of a key is first handled only after records 0..n-1 of that key
// were), how often each record ran and from which partition.
type Ledger struct {
	mu         sync.Mutex
	runs       map[int64]int
	next       map[string]int // per key: how many leading records were handled
	stale      []string
	violations []string
	outcomes   map[consume.Outcome]int
	partitions map[int64]int32 // record id -> the partition it last ran from
	distinct   int
	changed    chan struct{}
}

// NewLedger returns an empty Ledger.
func NewLedger() *Ledger {
	return &Ledger{runs: map[int64]int{}, next: map[string]int{}, outcomes: map[consume.Outcome]int{},
		partitions: map[int64]int32{}, changed: make(chan struct{}, 1)}
}

// Handle is a consumer handler's work on a record whose value is a
// Payload, read from partition: it reads the record's row where the
// router sent it and records the run.
func (l *Ledger) Handle(ctx context.Context, value []byte, partition int32) error {
	id, key, seq, err := ParsePayload(value)
	if err != nil {
		return err
	}
	var stale string
	if pool, err := consume.Pool(ctx, "main"); err != nil {
		stale = fmt.Sprintf("record %d: no pool in the handler's context: %v", id, err)
	} else {
		var gotKey string
		var gotSeq int
		err := pool.QueryRow(ctx, `SELECT key, seq FROM items WHERE id = $1`, id).Scan(&gotKey, &gotSeq)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			dec, _ := consume.DecisionFrom(ctx)
			stale = fmt.Sprintf("record %d: row not found (outcome %s)", id, dec.Outcome)
		case err != nil:
			return err
		case gotKey != key || gotSeq != seq:
			stale = fmt.Sprintf("record %d: read (%s,%d), want (%s,%d)", id, gotKey, gotSeq, key, seq)
		}
	}
	dec, routed := consume.DecisionFrom(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	if stale != "" {
		l.stale = append(l.stale, stale)
	}
	switch n := l.next[key]; {
	case seq == n:
		l.next[key] = n + 1
	case seq > n:
		l.violations = append(l.violations, fmt.Sprintf("key %s: record %d handled before record %d", key, seq, n))
	}
	l.runs[id]++
	if l.runs[id] == 1 {
		l.distinct++
	}
	l.partitions[id] = partition
	if routed {
		l.outcomes[dec.Outcome]++
	}
	// A signal left in changed's one-slot buffer after every run: a
	// waiter between its check and its wait does not miss it.
	select {
	case l.changed <- struct{}{}:
	default:
	}
	return nil
}

// Count is how many distinct records ran.
func (l *Ledger) Count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.distinct
}

// Stale and Violations are the stale reads and the per-key order
// violations seen so far.
func (l *Ledger) Stale() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.stale)
}

func (l *Ledger) Violations() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.violations)
}

// Outcomes counts the routed runs by the decision's outcome; Runs counts
// each record's runs; Partitions is the partition each record last ran
// from.
func (l *Ledger) Outcomes() map[consume.Outcome]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.outcomes)
}

func (l *Ledger) Runs() map[int64]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.runs)
}

func (l *Ledger) Partitions() map[int64]int32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.partitions)
}

// WaitDistinct waits until n distinct records ran, failing the test after
// timeout.
func (l *Ledger) WaitDistinct(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		if d := l.Count(); d >= n {
			return
		}
		select {
		case <-l.changed:
		case <-deadline:
			t.Fatalf("only %d of %d records ran within %v", l.Count(), n, timeout)
		}
	}
}

// Summary returns the stale reads, lost records, order violations and
// duplicate runs for ids 1..n.
func (l *Ledger) Summary(n int) (stale, lost, violations, dups int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for id := int64(1); id <= int64(n); id++ {
		switch r := l.runs[id]; {
		case r == 0:
			lost++
		case r > 1:
			dups += r - 1
		}
	}
	return len(l.stale), lost, len(l.violations), dups
}
