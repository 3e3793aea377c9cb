package consume

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Degraded state tends to hit every job at once: metrics count each job,
// the log samples. Each kind of warning lets its first warnFirst lines
// through, then one per warnInterval. What a producer is at fault for (a
// malformed token, a capture time in the future) is sampled per source
// (Job.Source), so that one misbehaving producer is easy to find and does
// not drown the others; jobs without a source share one sampler.
const (
	warnFirst    = 3
	warnInterval = 10 * time.Second
	// maxWarnSources bounds the per-source samplers, since sources are
	// the adapters' strings; jobs from sources past it share the sampler
	// of jobs without one.
	maxWarnSources = 1024
)

// warnKey names a sampler.
type warnKey struct {
	reason Reason // the decision's reason
	skew   bool   // the clock-skew warning instead
	source string // for what producers are at fault for; else ""
}

// warnings holds the samplers.
type warnings struct {
	mu      sync.Mutex
	m       map[warnKey]*rate.Sometimes
	sources int
}

func (w *warnings) sampler(k warnKey) *rate.Sometimes {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.m[k]; s != nil {
		return s
	}
	if k.source != "" {
		if w.sources >= maxWarnSources {
			k.source = ""
			if s := w.m[k]; s != nil {
				return s
			}
		} else {
			w.sources++
		}
	}
	if w.m == nil {
		w.m = make(map[warnKey]*rate.Sometimes)
	}
	s := &rate.Sometimes{First: warnFirst, Interval: warnInterval}
	w.m[k] = s
	return s
}

// logDecision logs a routed job: at Debug, or sampled at Warn when its
// reason is degraded or unknown state. tokErr is the token's decode
// error, which the malformed-token warning carries (a
// position.DecodeError prints a bounded, escaped excerpt of the text).
func (r *Router) logDecision(ctx context.Context, d *Decision, tokErr error, jobSource string) {
	if d.ClockSkew > 0 {
		r.warnClockSkew(ctx, d, jobSource)
	}
	warn := false
	switch d.Reason {
	case ReasonMalformedToken, ReasonEpoch, ReasonNoHealthyReplica, ReasonTrackerStale, ReasonUnknownDatabase, ReasonCapped, ReasonUnverified, ReasonMissingGrant, ReasonPrimaryBehind:
		warn = true
	}
	level := slog.LevelDebug
	if warn {
		level = slog.LevelWarn
	}
	if !r.log.Enabled(ctx, level) {
		return
	}
	source := ""
	if d.Reason == ReasonMalformedToken {
		source = jobSource
	}
	emit := func() {
		attrs := make([]slog.Attr, 0, 10+len(d.Databases))
		attrs = append(attrs,
			slog.String("db.system.name", "postgresql"),
			slog.String(attrPolicy, d.Policy.String()),
			slog.String(attrOutcome, d.Outcome.String()),
			slog.String(attrReason, d.Reason.String()),
			slog.Duration("caughtup.token_age", d.TokenAge),
		)
		if source != "" {
			attrs = append(attrs, slog.String(attrSource, source))
		}
		if tokErr != nil {
			attrs = append(attrs, slog.Any("error", tokErr))
		}
		if d.Waited > 0 {
			attrs = append(attrs, slog.Duration("caughtup.waited", d.Waited))
		}
		if d.Action == ActionDefer || d.Action == ActionRefuse {
			attrs = append(attrs, slog.Duration("caughtup.delay", d.Delay))
		}
		for _, dd := range d.Databases {
			g := []any{
				slog.String(attrOutcome, dd.Outcome.String()),
				slog.String(attrReason, dd.Reason.String()),
			}
			if dd.Replica != "" {
				g = append(g, slog.String(attrReplica, dd.Replica))
			}
			if dd.BytesBehind > 0 {
				g = append(g, slog.Uint64("caughtup.bytes_behind", dd.BytesBehind))
			}
			if dd.Reason == ReasonEpoch {
				g = append(g, slog.String("caughtup.incomparable", dd.Incomparable.String()))
			}
			attrs = append(attrs, slog.Group(attrDatabase+"."+dd.Database, g...))
		}
		r.log.LogAttrs(ctx, level, "caughtup: routed job", attrs...)
	}
	if !warn {
		emit()
		return
	}
	r.warns.sampler(warnKey{reason: d.Reason, source: source}).Do(emit)
}

// warnClockSkew logs, sampled per source, a token captured further in
// the future than Config.ClockSkewTolerance.
func (r *Router) warnClockSkew(ctx context.Context, d *Decision, source string) {
	if !r.log.Enabled(ctx, slog.LevelWarn) {
		return
	}
	r.warns.sampler(warnKey{skew: true, source: source}).Do(func() {
		attrs := []slog.Attr{
			slog.String("db.system.name", "postgresql"),
			slog.Duration("caughtup.clock_skew", d.ClockSkew),
			slog.Duration("caughtup.clock_skew_tolerance", r.cfg.ClockSkewTolerance),
			slog.String(attrPolicy, d.Policy.String()),
			slog.String(attrOutcome, d.Outcome.String()),
			slog.String(attrReason, d.Reason.String()),
		}
		if source != "" {
			attrs = append(attrs, slog.String(attrSource, source))
		}
		r.log.LogAttrs(ctx, slog.LevelWarn,
			"caughtup: token captured in the future: is the producer's clock ahead? Its age counts as unknown, so the job is not deferred",
			attrs...)
	})
}
