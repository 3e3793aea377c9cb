package consume

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

func TestNewRoutedBuffer(t *testing.T) {
	t.Parallel()
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/9000"))), func(*Config) {})
	for _, tally := range []*Tally{nil, r.NewTally()} {
		for n := range 5 {
			rc, buf := newRouted(n, tally)
			require.NotNil(t, rc)
			require.NotNil(t, buf)
			require.Empty(t, buf)
			require.GreaterOrEqual(t, cap(buf), n)
		}
	}
}

// TestTallyContextsNotReused: a Tally hands out its handler contexts in
// batches; every job keeps its own, across batches, so a handler that
// keeps its context still finds its own decision and child token in it.
func TestTallyContextsNotReused(t *testing.T) {
	t.Parallel()
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
	})
	tally := r.NewTally()
	const jobs = 3*routedBatch + 1
	ctxs := make([]context.Context, jobs)
	for i := range ctxs {
		tok := position.Of(t0.Add(-time.Second), position.Entry{Database: "main", Epoch: ep(1), LSN: position.LSN(1000 + i)})
		ctx, d, err := tally.Route(context.Background(), Job{Token: tok, TokenErr: nil, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome)
		ctxs[i] = ctx
	}
	for i, ctx := range ctxs {
		d, ok := DecisionFrom(ctx)
		require.True(t, ok)
		require.Len(t, d.Databases, 1)
		require.Equal(t, position.LSN(1000+i), d.Databases[0].Entry.LSN, "job %d's context holds another job's decision", i)
		for j := range i {
			require.NotSame(t, ctxs[j], ctx, "jobs %d and %d share a context", j, i)
		}
	}
}

// TestRoutedContext checks the handler's context against what
// context.WithValue and enqueue.WithToken gave before: values, the child
// token, cancellation and its text.
func TestRoutedContext(t *testing.T) {
	t.Parallel()
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/9000"))), func(c *Config) {
		c.WaitBudget = -1
		c.Now = func() time.Time { return t0 }
	})

	type key struct{}
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), key{}, "v"))
	jobTok := position.Of(t0.Add(-time.Second), ent("main", 1, "0/100"))
	hctx, d, err := r.Route(parent, Job{Token: jobTok, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome)
	got, ok := DecisionFrom(hctx)
	require.True(t, ok)
	require.Equal(t, d, got)
	require.Equal(t, "v", hctx.Value(key{}))
	child, ok := enqueue.TokenFrom(hctx)
	require.True(t, ok)
	require.Equal(t, childToken(jobTok, &d, child.CapturedAt), child)
	require.Equal(t, []position.Entry{{Database: "main", Epoch: ep(1), LSN: lsn("0/9000"), Source: position.SourceReplica}}, child.Entries)
	require.Equal(t, "context.Background.WithValue(consume.key, v).WithCancel.WithValue(consume.routingKey, *consume.routing).WithValue(enqueue.tokenKey, *consume.childSource)",
		fmt.Sprint(hctx))

	// Derived contexts see the values and the cancellation, its cause,
	// and AfterFunc fires; WithoutCancel keeps the values only.
	derived, stop := context.WithTimeout(hctx, time.Minute)
	defer stop()
	after := make(chan struct{})
	context.AfterFunc(hctx, func() { close(after) })
	detached := context.WithoutCancel(hctx)
	cause := errors.New("the partition was revoked")
	cancel(cause)
	<-derived.Done()
	<-after
	require.ErrorIs(t, derived.Err(), context.Canceled)
	require.ErrorIs(t, hctx.Err(), context.Canceled)
	require.Equal(t, cause, context.Cause(hctx))
	require.Equal(t, cause, context.Cause(derived))
	_, ok = DecisionFrom(derived)
	require.True(t, ok)
	require.NoError(t, detached.Err())
	_, ok = DecisionFrom(detached)
	require.True(t, ok)
	_, ok = enqueue.TokenFrom(detached)
	require.True(t, ok)
	require.Equal(t, "v", detached.Value(key{}))

	// No token: no child token, and the decision still travels.
	hctx, d, err = r.Route(context.Background(), hjob("", Delayed))
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
	_, ok = enqueue.TokenFrom(hctx)
	require.False(t, ok)
	_, ok = DecisionFrom(hctx)
	require.True(t, ok)
}

// TestRouteKeepsNothingOfTheToken: the handler's context rebuilds the job's
// token from the decision, so the caller may reuse the entries it routed
// (position.HeaderDecoder does): overwriting them afterwards changes
// neither the decision nor the child token, for every way a token with
// several databases is routed.
func TestRouteKeepsNothingOfTheToken(t *testing.T) {
	t.Parallel()
	s := snap(
		dbState("billing", 1, nil),
		dbState("ci", 1, nil, rep("c1", 1, "0/500")),
		dbState("main", 1, nil, rep("r1", 1, "0/9000"), rep("r2", 1, "0/100")),
	)
	r := unitRouter(t, s, func(c *Config) {
		c.WaitBudget = -1
		c.Now = func() time.Time { return t0 }
	})
	for _, tc := range []struct {
		name    string
		tok     position.Token
		policy  Policy
		outcome Outcome
	}{
		{"every database on a replica", tok(time.Second, ent("ci", 1, "0/400"), ent("main", 1, "0/200")), Delayed, OutcomeReplica},
		{"one on the primary", tok(time.Second, ent("billing", 1, "0/10"), ent("main", 1, "0/200")), Sticky, OutcomePrimary},
		{"policy always", tok(time.Second, ent("ci", 1, "0/400"), ent("main", 1, "0/200")), Always, OutcomePrimary},
		{"three databases", tok(time.Second, ent("billing", 1, "0/10"), ent("ci", 1, "0/400"), ent("main", 1, "0/8000")), Sticky, OutcomePrimary},
	} {
		t.Run(tc.name, func(t *testing.T) {
			entries := slices.Clone(tc.tok.Entries)
			routed := position.Token{Entries: entries, CapturedAt: tc.tok.CapturedAt}
			hctx, d, err := r.Route(context.Background(), Job{Token: routed, Policy: tc.policy})
			require.NoError(t, err)
			require.Equal(t, tc.outcome, d.Outcome)
			want := childToken(tc.tok, &d, t0)
			d = cloneDecision(d)
			for i := range entries {
				entries[i] = position.Entry{Database: "zz", Epoch: ep(9), LSN: 1}
			}
			got, ok := DecisionFrom(hctx)
			require.True(t, ok)
			require.Equal(t, d, got)
			child, ok := enqueue.TokenFrom(hctx)
			require.True(t, ok)
			require.Equal(t, want, child)
			for i, dd := range got.Databases {
				require.Equal(t, tc.tok.Entries[i], dd.Entry)
			}
		})
	}
}

// cloneDecision is d with Databases of its own.
func cloneDecision(d Decision) Decision {
	d.Databases = slices.Clone(d.Databases)
	return d
}

// TestRouteInSession: in an enqueue session (the net/http middleware's),
// the handler's child token goes to the session, which computes it when
// first asked for: the session's token is then what merging the child
// token at once gave, before and after the handler's own writes, for
// jobs routed by the Router and through a Tally (whose next job with the
// same token and context repeats the decision, and adds nothing). The
// child token takes two allocations.
func TestRouteInSession(t *testing.T) {
	r := unitRouter(t, snap(dbState("ci", 1, nil), dbState("main", 1, nil, rep("r1", 1, "0/9000"))), func(c *Config) {
		c.WaitBudget = -1
		c.Now = func() time.Time { return t0 }
	})
	before := position.Of(t0.Add(-time.Minute), ent("ci", 1, "0/50"))
	write := position.Of(t0.Add(time.Second), ent("main", 1, "0/9500"))
	for _, tc := range []struct {
		name  string
		tok   position.Token
		route func(context.Context, Job) (context.Context, Decision, error)
	}{
		{"router", tok(time.Second, ent("main", 1, "0/100")), r.Route},
		{"tally", tok(time.Second, ent("main", 1, "0/100")), r.NewTally().Route},
		{"two databases", tok(time.Second, ent("ci", 1, "0/60"), ent("main", 1, "0/100")), r.Route},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := enqueue.WithSession(enqueue.WithToken(context.Background(), before))
			hctx, d, err := tc.route(ctx, Job{Token: tc.tok, Policy: Sticky})
			require.NoError(t, err)
			child := childToken(tc.tok, &d, t0)
			require.False(t, child.IsZero())
			// A handler that keeps the context it was given, and one that
			// drops the one a write returned.
			got, ok := enqueue.TokenFrom(hctx)
			require.True(t, ok)
			require.Equal(t, before.Merge(child), got)
			_ = enqueue.WithToken(hctx, write)
			got, _ = enqueue.TokenFrom(ctx)
			require.Equal(t, before.Merge(child).Merge(write), got)

			again, _, err := tc.route(ctx, Job{Token: tc.tok, Policy: Sticky})
			require.NoError(t, err)
			got, _ = enqueue.TokenFrom(again)
			require.Equal(t, before.Merge(child).Merge(write), got)
		})
	}

	hctx, _, err := r.Route(context.Background(), Job{Token: tok(time.Second, ent("main", 1, "0/100")), Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, 2.0, testing.AllocsPerRun(100, func() { _, _ = enqueue.TokenFrom(hctx) }))
}
