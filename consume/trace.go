package consume

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/internal/tracing"
)

// The routing spans. A span, unlike the metrics, says which job a decision
// was about: the caughtup.route span of a job that waited seconds for a
// replica, or read the primary, sits in that job's trace, beside the
// handler's queries. They are made only inside a trace (the context of
// Route has a span: the producer's, continued from the job's headers, or
// the consumer's own); a job outside any trace gets none.
const (
	// SpanRoute covers Router.Route: deciding, waiting, the fallback cap.
	// Its attributes are the decision (TraceAttributes).
	SpanRoute = "caughtup.route"
	// SpanWait is the child of SpanRoute for the time the job waited
	// inside Route: for a replica to replay its token (Policy Delayed),
	// or, held (Job.Hold), for a replica or the fallback cap.
	SpanWait = "caughtup.wait"
	// SpanDefer is an adapter's span for a deferral: asynq's rescheduled
	// task, the Kafka consumer's wait in place or its republication to the
	// retry topic. Its attributes are the decision's.
	SpanDefer = "caughtup.defer"
	// SpanWake is an adapter's span for running deferred jobs early, once a
	// replica has replayed their tokens (asynq's move of retried tasks to
	// pending), linked to the deferrals' spans.
	SpanWake = "caughtup.wake"
)

// Span attribute keys besides the metrics' (caughtup.policy,
// caughtup.outcome, caughtup.reason, caughtup.database, caughtup.replica).
const (
	attrAction     = "caughtup.action"
	attrFallback   = "caughtup.fallback"
	attrHeld       = "caughtup.held"
	attrWaited     = "caughtup.waited"      // seconds
	attrTokenAge   = "caughtup.token.age"   // seconds
	attrDelay      = "caughtup.defer.delay" // seconds
	attrDatabases  = "caughtup.databases"   // jobs of several databases
	attrReplicas   = "caughtup.replicas"
	attrWaitFor    = "caughtup.wait.for"
	waitForReplica = "replica"
	waitForCap     = "replica_or_fallback_cap"
)

func newTracer(tp trace.TracerProvider) trace.Tracer {
	return tp.Tracer(ScopeName)
}

// StartDefer starts an adapter's SpanDefer span for the deferral de, a
// consumer span inside ctx's trace only (none outside a trace, as the
// router's), with the decision's attributes (TraceAttributes) and, on a
// recorded span, those job returns: the adapter's names for the job.
// The caller ends it.
func StartDefer(ctx context.Context, tracer trace.Tracer, de *DeferError, job func() []attribute.KeyValue) (context.Context, trace.Span) {
	ctx, span := tracing.Start(ctx, tracer, SpanDefer, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(TraceAttributes(&de.Decision)...)
		if job != nil {
			span.SetAttributes(job()...)
		}
	}
	return ctx, span
}

// TraceAttributes returns d as span attributes, those of the
// caughtup.route span: the adapters put them on spans of their own (a
// deferral's) too.
func TraceAttributes(d *Decision) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 0, 12)
	attrs = append(attrs,
		attribute.String(attrPolicy, d.Policy.String()),
		attribute.String(attrAction, d.Action.String()),
		attribute.String(attrOutcome, d.Outcome.String()),
		attribute.String(attrReason, d.Reason.String()),
		attribute.Bool(attrFallback, d.Fallback),
		attribute.Float64(attrTokenAge, d.TokenAge.Seconds()),
	)
	if d.Waited > 0 {
		attrs = append(attrs, attribute.Float64(attrWaited, d.Waited.Seconds()))
	}
	if d.Held {
		attrs = append(attrs, attribute.Bool(attrHeld, true))
	}
	if d.Action == ActionDefer || d.Action == ActionRefuse {
		attrs = append(attrs, attribute.Float64(attrDelay, d.Delay.Seconds()))
	}
	switch len(d.Databases) {
	case 0:
	case 1:
		dd := &d.Databases[0]
		attrs = append(attrs, attribute.String(attrDatabase, dd.Database))
		if dd.Replica != "" {
			attrs = append(attrs, attribute.String(attrReplica, dd.Replica))
		}
	default:
		dbs := make([]string, len(d.Databases))
		reps := make([]string, len(d.Databases))
		for i := range d.Databases {
			dbs[i], reps[i] = d.Databases[i].Database, d.Databases[i].Replica
		}
		attrs = append(attrs, attribute.StringSlice(attrDatabases, dbs), attribute.StringSlice(attrReplicas, reps))
	}
	return attrs
}

// endRoute ends the caughtup.route span with the decision made. A
// deferral or a refusal is a decision, not a failure; only an abandoned
// wait (ctx ended) or a failed verification marks the span as an error.
func endRoute(span trace.Span, job *Job, d *Decision, err error) {
	if span.IsRecording() {
		span.SetAttributes(TraceAttributes(d)...)
		if job.Source != "" {
			span.SetAttributes(attribute.String(attrSource, job.Source))
		}
		var de *DeferError
		if err != nil && !errors.As(err, &de) {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// startWait starts the caughtup.wait span, a child of ctx's caughtup.route.
func (r *Router) startWait(ctx context.Context, waitFor string) trace.Span {
	_, span := tracing.Start(ctx, r.tracer, SpanWait, trace.WithAttributes(attribute.String(attrWaitFor, waitFor)))
	return span
}

// endWait ends a caughtup.wait span with what the wait came to.
func endWait(span trace.Span, d *Decision, err error) {
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String(attrAction, d.Action.String()),
			attribute.String(attrOutcome, d.Outcome.String()),
		)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}
