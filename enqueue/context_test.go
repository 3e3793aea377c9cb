package enqueue_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

var (
	epoch1 = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
	epoch2 = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 2}
	t0     = time.Date(2025, 11, 29, 12, 0, 0, 0, time.UTC)
)

func tok(db string, e position.Epoch, lsn string, src position.Source, at time.Time) position.Token {
	return position.New(db, e, position.MustParseLSN(lsn), src, at)
}

func TestTokenFromEmpty(t *testing.T) {
	t.Parallel()
	got, ok := enqueue.TokenFrom(context.Background())
	require.False(t, ok)
	require.True(t, got.IsZero())

	// An empty token does not create a context value.
	ctx := context.Background()
	require.Equal(t, ctx, enqueue.WithToken(ctx, position.Token{}))
}

func TestWithTokenMerges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ctx = enqueue.WithToken(ctx, tok("main", epoch1, "0/3000", position.SourcePrimary, t0.Add(time.Second)))
	ctx = enqueue.WithToken(ctx, tok("main", epoch1, "0/2000", position.SourceReplica, t0))
	ctx = enqueue.WithToken(ctx, tok("ci", epoch2, "1/0", position.SourcePrimary, t0.Add(2*time.Second)))

	got, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok)
	require.Equal(t, position.Token{
		CapturedAt: t0, // the oldest capture
		Entries: []position.Entry{
			{Database: "ci", Epoch: epoch2, LSN: position.MustParseLSN("1/0"), Source: position.SourcePrimary},
			// the furthest position of "main", with its source
			{Database: "main", Epoch: epoch1, LSN: position.MustParseLSN("0/3000"), Source: position.SourcePrimary},
		},
	}, got)
}

func TestWithTokenDoesNotChangeParent(t *testing.T) {
	t.Parallel()
	parent := enqueue.WithToken(context.Background(), tok("main", epoch1, "0/1000", position.SourcePrimary, t0))
	child := enqueue.WithToken(parent, tok("main", epoch1, "0/9000", position.SourcePrimary, t0))

	p, _ := enqueue.TokenFrom(parent)
	c, _ := enqueue.TokenFrom(child)
	require.Equal(t, position.MustParseLSN("0/1000"), p.Entries[0].LSN)
	require.Equal(t, position.MustParseLSN("0/9000"), c.Entries[0].LSN)
}

func TestWithTokenAcrossTimelines(t *testing.T) {
	t.Parallel()
	// A write before and one after a failover: the later timeline wins
	// with the larger LSN (position.Token.Merge).
	ctx := enqueue.WithToken(context.Background(), tok("main", epoch1, "0/5000", position.SourcePrimary, t0))
	ctx = enqueue.WithToken(ctx, tok("main", epoch2, "0/4000", position.SourcePrimary, t0))
	got, _ := enqueue.TokenFrom(ctx)
	require.Equal(t, epoch2, got.Entries[0].Epoch)
	require.Equal(t, position.MustParseLSN("0/5000"), got.Entries[0].LSN)

	// Another system: the epoch becomes unknown, which never compares as
	// caught up, so the job reads "main" from the primary.
	other := position.Epoch{SystemID: 42, Timeline: 1}
	ctx = enqueue.WithToken(ctx, tok("main", other, "0/1", position.SourcePrimary, t0))
	got, _ = enqueue.TokenFrom(ctx)
	require.True(t, got.Entries[0].Epoch.IsZero())
}

func TestSessionCollectsDroppedContexts(t *testing.T) {
	t.Parallel()
	base := enqueue.WithToken(context.Background(), tok("main", epoch1, "0/1000", position.SourcePrimary, t0))
	ctx := enqueue.WithSession(base)
	got, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok, "the session starts with the token ctx carried")
	require.Equal(t, position.MustParseLSN("0/1000"), got.Entries[0].LSN)

	// A helper that merges and drops the returned context.
	write := func(ctx context.Context, lsn string) {
		_ = enqueue.WithToken(ctx, tok("main", epoch1, lsn, position.SourcePrimary, t0.Add(time.Minute)))
	}
	derived, cancel := context.WithCancel(ctx)
	defer cancel()
	write(derived, "0/8000")

	got, _ = enqueue.TokenFrom(ctx)
	require.Equal(t, position.MustParseLSN("0/8000"), got.Entries[0].LSN)
	require.Equal(t, t0, got.CapturedAt)

	// The context the session was made from is unaffected, and a second
	// WithSession does not start a new session.
	b, _ := enqueue.TokenFrom(base)
	require.Equal(t, position.MustParseLSN("0/1000"), b.Entries[0].LSN)
	require.Equal(t, ctx, enqueue.WithSession(ctx))
}

func TestSessionConcurrent(t *testing.T) {
	t.Parallel()
	ctx := enqueue.WithSession(context.Background())
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			enqueue.WithToken(ctx, position.New("main", epoch1, position.LSN(1000+i), position.SourcePrimary, t0.Add(time.Duration(i)*time.Second)))
			_, _ = enqueue.TokenFrom(ctx)
		})
	}
	wg.Wait()
	got, _ := enqueue.TokenFrom(ctx)
	require.Equal(t, position.LSN(1063), got.Entries[0].LSN)
	require.Equal(t, t0, got.CapturedAt)
}

func TestConfig(t *testing.T) {
	t.Parallel()
	d := enqueue.Config{}.WithDefaults()
	require.Equal(t, "main", d.Database)
	require.Equal(t, enqueue.DefaultSystemIDRefresh, d.SystemIDRefresh)
	require.NotNil(t, d.Now)
	require.NoError(t, enqueue.Config{}.Validate())
	require.Error(t, enqueue.Config{Database: "no spaces"}.Validate())
	require.Panics(t, func() { enqueue.NewCapturer(enqueue.Config{Database: "a;b"}) })
	require.Equal(t, "ci", enqueue.NewCapturer(enqueue.Config{Database: "ci"}).Database())
}

func TestCaptureErrorMessages(t *testing.T) {
	t.Parallel()
	err := error(&enqueue.CaptureError{Database: "main", Committed: true, Err: context.Canceled})
	require.ErrorIs(t, err, context.Canceled)
	require.Contains(t, err.Error(), "committed")
	require.Contains(t, err.Error(), "do not retry")
	err = &enqueue.CaptureError{Database: "main", Err: enqueue.ErrPoolTx}
	require.ErrorIs(t, err, enqueue.ErrPoolTx)
	require.Contains(t, err.Error(), "nothing committed")
}

// fixedSource is a TokenSource that counts its calls.
type fixedSource struct {
	tok   position.Token
	calls int
}

func (s *fixedSource) Token() position.Token { s.calls++; return s.tok }

// The handler's token (enqueue.WithTokenSource) is what enqueue.WithToken
// with the same token would have given, in every position of a context
// chain, and computed only when asked for.
func TestWithTokenSourceAsWithToken(t *testing.T) {
	t.Parallel()
	a := position.Of(t0, position.Entry{Database: "main", Epoch: epoch1, LSN: 0x3000})
	b := position.Of(t0.Add(-time.Second), position.Entry{Database: "main", Epoch: epoch1, LSN: 0x2000}, position.Entry{Database: "ci", Epoch: epoch1, LSN: 0x10})
	c := position.Of(t0.Add(time.Second), position.Entry{Database: "ci", Epoch: epoch1, LSN: 0x20})
	check := func(t *testing.T, build func(add func(context.Context, position.Token) context.Context) context.Context) {
		t.Helper()
		eager := build(enqueue.WithToken)
		want, wantOK := enqueue.TokenFrom(eager)
		// Both ways of carrying a source: a context of its own, and a
		// SourceContext in the caller's allocation.
		for name, carry := range map[string]func(context.Context, enqueue.TokenSource) context.Context{
			"WithTokenSource": enqueue.WithTokenSource,
			"SourceContext": func(parent context.Context, src enqueue.TokenSource) context.Context {
				c := &enqueue.SourceContext{}
				c.Init(parent, src)
				return c
			},
		} {
			var srcs []*fixedSource
			lazy := build(func(ctx context.Context, tok position.Token) context.Context {
				s := &fixedSource{tok: tok}
				srcs = append(srcs, s)
				return carry(ctx, s)
			})
			got, ok := enqueue.TokenFrom(lazy)
			require.Equal(t, wantOK, ok, name)
			require.Equal(t, want, got, name)
			for _, s := range srcs {
				require.LessOrEqual(t, s.calls, 1, name)
			}
		}
	}
	bg := context.Background()
	t.Run("alone", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context { return add(bg, a) })
	})
	t.Run("over a token", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			return add(enqueue.WithToken(bg, a), b)
		})
	})
	t.Run("nested", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			return add(add(bg, a), b)
		})
	})
	t.Run("under WithToken", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			return enqueue.WithToken(add(add(bg, a), b), c)
		})
	})
	t.Run("under WithSession", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			ctx := enqueue.WithSession(add(bg, b))
			_ = enqueue.WithToken(ctx, c)
			return ctx
		})
	})
	t.Run("in a session", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			ctx := enqueue.WithSession(enqueue.WithToken(bg, a))
			_ = add(ctx, b) // dropped: the session keeps it
			return ctx
		})
	})
	t.Run("empty", func(t *testing.T) {
		check(t, func(add func(context.Context, position.Token) context.Context) context.Context {
			return add(enqueue.WithToken(bg, a), position.Token{})
		})
	})

	// Not computed until asked for, then every time.
	s := &fixedSource{tok: a}
	ctx := enqueue.WithTokenSource(bg, s)
	require.Zero(t, s.calls)
	got, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok)
	require.Equal(t, a, got)
	require.Equal(t, 1, s.calls)
	require.Equal(t, bg, enqueue.WithTokenSource(bg, nil))
}

// A SourceContext is its parent for everything but the token: values,
// cancellation and its cause, and its text reads as WithTokenSource's.
func TestSourceContext(t *testing.T) {
	t.Parallel()
	type key struct{}
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), key{}, "v"))
	a := position.Of(t0, position.Entry{Database: "main", Epoch: epoch1, LSN: 0x3000})
	s := &fixedSource{tok: a}
	c := &enqueue.SourceContext{}
	c.Init(parent, s)
	require.Zero(t, s.calls)
	require.Equal(t, "v", c.Value(key{}))
	require.Equal(t, fmt.Sprint(enqueue.WithTokenSource(parent, s)), fmt.Sprint(c))
	got, ok := enqueue.TokenFrom(c)
	require.True(t, ok)
	require.Equal(t, a, got)

	cause := errors.New("revoked")
	cancel(cause)
	<-c.Done()
	require.ErrorIs(t, c.Err(), context.Canceled)
	require.Equal(t, cause, context.Cause(c))

	// Init again reuses it; a nil source carries nothing.
	c.Init(context.Background(), nil)
	_, ok = enqueue.TokenFrom(c)
	require.False(t, ok)
	require.NoError(t, c.Err())
	require.Equal(t, "context.Background", fmt.Sprint(c))
}

// countingSource is a TokenSource that counts its calls, safe for
// concurrent use.
type countingSource struct {
	tok   position.Token
	calls atomic.Int32
}

func (s *countingSource) Token() position.Token { s.calls.Add(1); return s.tok }

// A token source handed to a session (a routed handler's child token in
// the net/http middleware's session) is computed only when the session's
// token is asked for or merged into, once, and the session's token is
// the same as if it had been merged at once: random sequences of sources,
// tokens and reads against a model of the session that merges each at
// once. The tokens include non-normal ones and capture times that are
// one instant in different locations, so that merging in another order,
// or taking the starting token otherwise than as it is, shows.
func TestSessionMergesSourcesWhenAsked(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 5))
	locs := []*time.Location{time.UTC, time.FixedZone("A", 3600), time.FixedZone("B", -7200)}
	randTok := func() position.Token {
		var tk position.Token
		if rng.IntN(5) > 0 {
			tk.CapturedAt = t0.Add(time.Duration(rng.IntN(3)) * time.Second).In(locs[rng.IntN(len(locs))])
		}
		for range rng.IntN(4) {
			tk.Entries = append(tk.Entries, position.Entry{
				Database: []string{"main", "ci", "billing"}[rng.IntN(3)],
				Epoch:    []position.Epoch{epoch1, epoch2, {}}[rng.IntN(3)],
				LSN:      position.LSN(rng.IntN(4) * 0x1000),
				Source:   position.Source(rng.IntN(4)),
			})
		}
		return tk // unsorted and repeated databases included: not normal
	}
	for round := range 2000 {
		var model position.Token // the session, merging everything at once
		var pending []*countingSource
		parent := context.Background()
		switch rng.IntN(3) {
		case 0: // a token to start from
			tk := randTok()
			parent = enqueue.WithToken(parent, tk)
			model, _ = enqueue.TokenFrom(parent)
		case 1: // a token source to start from
			src := &countingSource{tok: randTok()}
			parent = enqueue.WithTokenSource(parent, src)
			model = src.tok
			pending = append(pending, src)
		}
		ctx := enqueue.WithSession(parent)
		asked := 0 // pending[:asked] have been merged
		for op := range 6 {
			switch rng.IntN(4) {
			case 0, 1: // a source, carried either way
				src := &countingSource{tok: randTok()}
				if rng.IntN(2) == 0 {
					require.Same(t, ctx, enqueue.WithTokenSource(ctx, src))
				} else {
					(&enqueue.SourceContext{}).Init(ctx, src)
				}
				model = model.Merge(src.tok)
				asked = len(pending)
				pending = append(pending, src)
			case 2:
				tk := randTok()
				_ = enqueue.WithToken(ctx, tk)
				if !tk.IsZero() || !tk.CapturedAt.IsZero() {
					model = model.Merge(tk)
					asked = len(pending)
				}
			case 3:
				got, ok := enqueue.TokenFrom(ctx)
				require.Equal(t, model, got, "round %d op %d", round, op)
				require.Equal(t, !model.IsZero(), ok)
				asked = len(pending)
			}
			// Computed once the session was read or merged into after
			// it was added; never before, never twice.
			for i, src := range pending {
				want := int32(0)
				if i < asked {
					want = 1
				}
				require.Equal(t, want, src.calls.Load(), "round %d op %d source %d of %d", round, op, i, len(pending))
			}
		}
		got, _ := enqueue.TokenFrom(ctx)
		require.Equal(t, model, got, "round %d", round)
	}
}

// Sources, tokens and reads from many goroutines at once (run with
// -race): every source is computed once, and the session ends with
// everything merged.
func TestSessionSourcesConcurrent(t *testing.T) {
	t.Parallel()
	ctx := enqueue.WithSession(context.Background())
	srcs := make([]*countingSource, 64)
	var wg sync.WaitGroup
	for i := range srcs {
		srcs[i] = &countingSource{tok: position.New("ci", epoch1, position.LSN(1000+i), position.SourceReplica, t0.Add(time.Duration(i)*time.Second))}
		wg.Go(func() {
			if i%2 == 0 {
				_ = enqueue.WithTokenSource(ctx, srcs[i])
			} else {
				(&enqueue.SourceContext{}).Init(ctx, srcs[i])
			}
			enqueue.WithToken(ctx, position.New("main", epoch1, position.LSN(1000+i), position.SourcePrimary, t0.Add(time.Duration(i)*time.Second)))
			_, _ = enqueue.TokenFrom(ctx)
		})
	}
	wg.Wait()
	got, _ := enqueue.TokenFrom(ctx)
	require.Equal(t, position.Token{CapturedAt: t0, Entries: []position.Entry{
		{Database: "ci", Epoch: epoch1, LSN: 1063, Source: position.SourceReplica},
		{Database: "main", Epoch: epoch1, LSN: 1063, Source: position.SourcePrimary},
	}}, got)
	for i, src := range srcs {
		require.Equal(t, int32(1), src.calls.Load(), "source %d", i)
	}
}
