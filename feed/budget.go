package feed

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

// DefaultBudgetPrefix starts the key of every Budget with an empty
// BudgetConfig.Prefix.
const DefaultBudgetPrefix = "caughtup.budget."

// budgetRedisPrefix is what redis_rate puts before every key.
const budgetRedisPrefix = "rate:"

// ErrBudgetUnavailable is wrapped by Allow's errors: the fleet budget
// could not be consulted (Redis slow, unreachable or refusing), and the
// caller's per-process cap alone decides.
var ErrBudgetUnavailable = errors.New("caughtup/feed: fleet budget unavailable; fall back to the per-process cap")

// BudgetConfig configures a Budget. The zero value of every field but
// Client and Rate means its documented default.
type BudgetConfig struct {
	// Client is the Redis every process of the fleet shares. Required. The
	// Budget never closes it.
	Client redis.UniversalClient

	// Rate events per Period are allowed fleet-wide per key. At least 1.
	// Required.
	Rate int

	// Period is the window Rate is counted over. Must not be negative.
	// Default: 1s.
	Period time.Duration

	// Burst is how many events may pass at once after a quiet spell. Over
	// any span t, at most Rate×t/Period + Burst events pass. Must not be
	// negative.
	// Default: Rate (one Period's worth).
	// As redis_rate's PerSecond does.
	Burst int

	// Prefix starts every key in Redis (after redis_rate's own "rate:").
	// Default: DefaultBudgetPrefix ("caughtup.budget.").
	// One ACL pattern then covers every key (BudgetACL).
	Prefix string

	// Timeout bounds each Allow's round trip. Must not be negative.
	// Default: 50ms.
	// A LAN round trip is well under a millisecond, so 50ms means trouble,
	// and a job headed for the primary should not wait longer for the
	// answer.
	Timeout time.Duration

	// Cooldown: after an error, Allow returns ErrBudgetUnavailable at once
	// for this long instead of asking Redis again. Must not be negative.
	// Default: 1s.
	// An unreachable or black-holed Redis then costs routing nothing.
	Cooldown time.Duration
}

// WithDefaults returns c with every zero field set to its default.
func (c BudgetConfig) WithDefaults() BudgetConfig {
	if c.Period == 0 {
		c.Period = time.Second
	}
	if c.Burst == 0 {
		c.Burst = c.Rate
	}
	if c.Prefix == "" {
		c.Prefix = DefaultBudgetPrefix
	}
	if c.Timeout == 0 {
		c.Timeout = 50 * time.Millisecond
	}
	if c.Cooldown == 0 {
		c.Cooldown = time.Second
	}
	return c
}

// Validate reports what is wrong with c, after defaults.
func (c BudgetConfig) Validate() error {
	switch {
	case c.Client == nil:
		return fmt.Errorf("%w: BudgetConfig.Client is required", ErrInvalidConfig)
	case c.Rate < 1:
		return fmt.Errorf("%w: BudgetConfig.Rate must be at least 1 event per Period", ErrInvalidConfig)
	case c.Period <= 0 || c.Burst < 1:
		return fmt.Errorf("%w: BudgetConfig.Period must be positive and Burst at least 1", ErrInvalidConfig)
	case c.Timeout <= 0 || c.Cooldown < 0:
		return fmt.Errorf("%w: BudgetConfig.Timeout must be positive and Cooldown not negative", ErrInvalidConfig)
	}
	return nil
}

// Budget is a rate limit shared by every process that uses the same Redis
// and key: GCRA (generic cell rate algorithm) in one Lua script per call,
// through github.com/go-redis/redis_rate, on Redis's clock. Safe for
// concurrent use.
type Budget struct {
	cfg     BudgetConfig
	limiter *redis_rate.Limiter
	limit   redis_rate.Limit
	// until is the UnixNano before which Allow does not ask Redis again.
	until atomic.Int64
}

// NewBudget validates cfg.
func NewBudget(cfg BudgetConfig) (*Budget, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Budget{
		cfg:     cfg,
		limiter: redis_rate.NewLimiter(cfg.Client),
		limit:   redis_rate.Limit{Rate: cfg.Rate, Burst: cfg.Burst, Period: cfg.Period},
	}, nil
}

// Allow takes one event from key's budget (key: e.g. the database name
// or the primary's system identifier; every process must use the same).
// It returns within Timeout. An error wraps ErrBudgetUnavailable: the
// budget could not be consulted, allowed is false, and the caller applies
// its per-process cap alone (and logs and counts that).
func (b *Budget) Allow(ctx context.Context, key string) (allowed bool, err error) {
	if until := b.until.Load(); until != 0 && time.Now().UnixNano() < until {
		return false, fmt.Errorf("%w: Redis failed less than %v ago", ErrBudgetUnavailable, b.cfg.Cooldown)
	}
	tctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	defer cancel()
	// go-redis bounds a new connection's handshake by the client's
	// ReadTimeout (3s by default), not by the context: against a Redis
	// that accepts connections and never answers, the call would outlast
	// Timeout. So Allow waits for the context, not for the call, which
	// ends on its own within the client's timeouts (and the cooldown
	// keeps more from piling up meanwhile).
	done := make(chan allowResult, 1)
	go func() {
		res, err := b.limiter.Allow(tctx, b.cfg.Prefix+key, b.limit)
		done <- allowResult{res, err}
	}()
	var r allowResult
	select {
	case r = <-done:
	case <-tctx.Done():
		r.err = tctx.Err()
	}
	res, err := r.res, r.err
	if err != nil {
		// The caller giving up says nothing about Redis.
		if b.cfg.Cooldown > 0 && ctx.Err() == nil {
			b.until.Store(time.Now().Add(b.cfg.Cooldown).UnixNano())
		}
		if ctx.Err() == nil {
			// A Cluster's slot map may name a dead master (cluster.go).
			reloadSlots(ctx, b.cfg.Client)
		}
		return false, fmt.Errorf("%w: %w", ErrBudgetUnavailable, err)
	}
	b.until.Store(0)
	return res.Allowed > 0, nil
}

type allowResult struct {
	res *redis_rate.Result
	err error
}
