package consume

import (
	"context"
	"iter"
	"log/slog"
	"slices"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"
)

// FleetBudget is a budget of primary fallback reads shared by every
// process of a fleet, one per key; *feed.Budget (GCRA in Redis) is one.
// Allow takes one read from key's budget. An error means the budget could
// not be consulted (Redis slow or unreachable): the Router then applies
// its per-process cap alone, and logs and counts that.
type FleetBudget interface {
	Allow(ctx context.Context, key string) (allowed bool, err error)
}

// fallbackGate admits promotions to the primary caused by lag or unknown
// replica state: each must pass the per-process cap (Config.PrimaryRate
// and PrimaryBurst) and, when Config.FleetBudget is set, the fleet budget
// of every database the job reads from the primary for that reason (key:
// the database name, which every process of the fleet shares because
// tokens carry it).
type fallbackGate struct {
	lim    *rate.Limiter
	budget FleetBudget
	log    *slog.Logger
	checks metric.Int64Counter

	fleetAllowed, fleetSpent, fleetUnavailable metric.MeasurementOption
	localAllowed, localSpent                   metric.MeasurementOption

	warn rate.Sometimes
}

func newFallbackGate(cfg *Config, log *slog.Logger) (*fallbackGate, error) {
	g := &fallbackGate{
		lim:    rate.NewLimiter(cfg.PrimaryRate, cfg.PrimaryBurst),
		budget: cfg.FleetBudget,
		log:    log,
		warn:   rate.Sometimes{First: 1, Interval: 10 * time.Second},
	}
	mp := cfg.MeterProvider
	set := func(budget, result string) metric.MeasurementOption {
		return withSystem(attribute.String(attrBudget, budget), attribute.String(attrResult, result))
	}
	g.fleetAllowed, g.fleetSpent, g.fleetUnavailable = set("fleet", "allowed"), set("fleet", "spent"), set("fleet", "unavailable")
	g.localAllowed, g.localSpent = set("local", "allowed"), set("local", "spent")
	var err error
	g.checks, err = mp.Meter(ScopeName).Int64Counter("caughtup.consume.fallback.budget",
		metric.WithUnit("{check}"),
		metric.WithDescription("Checks of a primary fallback against the per-process cap (caughtup.budget local) and the fleet budget (fleet), by result: allowed, spent, or, for the fleet budget, unavailable (Redis could not answer; the per-process cap alone decided)."))
	return g, err
}

// chargeFallback asks the fallback cap for d's promotion to the primary
// (a run on the primary for lag or unknown state). A refusal decides
// again with in.Capped, which turns the promotion into a deferral or
// OutcomeCapped; the time d has waited stays as it was.
func (r *Router) chargeFallback(ctx context.Context, in *DecideInput, d *Decision) {
	if d.Action != ActionRun || !d.Fallback || r.gate.allow(ctx, d) {
		return
	}
	in.Capped = true
	waited := d.Waited
	decide(in, d)
	d.Waited = waited
}

// allow charges one fallback read of decision d: to the per-process cap,
// and to the fleet budget of every database d reads from the primary for
// lag or unknown state, each once; false when either is spent.
func (g *fallbackGate) allow(ctx context.Context, d *Decision) bool {
	return g.charge(ctx, func(yield func(string) bool) {
		for i := range d.Databases {
			dd := &d.Databases[i]
			if dd.replica >= 0 || !dd.Reason.fallback() || charged(d.Databases[:i], dd.Database) {
				continue
			}
			if !yield(dd.Database) {
				return
			}
		}
	})
}

// AllowFallback charges one primary read to the router's fallback cap, as
// a job's fallback is charged, for a caller that reads the primary
// outside Route: the per-process cap (Config.PrimaryRate and
// PrimaryBurst) and, with a Config.FleetBudget, the fleet budget of each
// of databases (the names of Config.Databases the read uses; a name given
// twice is charged once). It returns false, and charges nothing more,
// when either is spent: the caller must then not read the primary.
// An unavailable fleet budget leaves the per-process cap to decide, as
// for jobs. Every check is counted in caughtup.consume.fallback.budget.
//
// caughtuphttp calls it for a request whose session value it rejected:
// such a request would otherwise read the primary without a token, which
// Route never charges (OutcomePrimaryNoToken).
func (r *Router) AllowFallback(ctx context.Context, databases ...string) bool {
	return r.gate.charge(ctx, func(yield func(string) bool) {
		for i, db := range databases {
			if slices.Contains(databases[:i], db) {
				continue
			}
			if !yield(db) {
				return
			}
		}
	})
}

// charge is the one rule for a fallback read: fleet, the keys of the
// fleet budgets it reads from, each once. The local cap is looked at
// first and charged last, so that a fleet refusal costs the process's cap
// nothing and a spent local cap costs the fleet nothing (two goroutines
// racing for the last local token may waste one fleet token).
func (g *fallbackGate) charge(ctx context.Context, fleet iter.Seq[string]) bool {
	bg := context.Background()
	if g.lim.Limit() != rate.Inf && g.lim.Tokens() < 1 {
		g.checks.Add(bg, 1, g.localSpent)
		return false
	}
	if g.budget != nil {
		for db := range fleet {
			ok, err := g.budget.Allow(ctx, db)
			switch {
			case err != nil:
				g.checks.Add(bg, 1, g.fleetUnavailable)
				g.warn.Do(func() {
					g.log.Warn("caughtup: the fleet primary budget is unavailable; the per-process cap alone bounds this process's primary fallbacks until it answers (see caughtup.consume.fallback.budget)",
						slog.String(attrDatabase, db), slog.Any("error", err))
				})
			case !ok:
				g.checks.Add(bg, 1, g.fleetSpent)
				return false
			default:
				g.checks.Add(bg, 1, g.fleetAllowed)
			}
		}
	}
	if !g.lim.Allow() {
		g.checks.Add(bg, 1, g.localSpent)
		return false
	}
	g.checks.Add(bg, 1, g.localAllowed)
	return true
}

// charged reports whether an earlier database of the same decision
// already took from name's budget.
func charged(earlier []DatabaseDecision, name string) bool {
	for i := range earlier {
		if dd := &earlier[i]; dd.Database == name && dd.replica < 0 && dd.Reason.fallback() {
			return true
		}
	}
	return false
}
