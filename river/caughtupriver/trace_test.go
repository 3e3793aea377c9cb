package caughtupriver_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
	"github.com/caughtup/caughtup/testkit/spantest"
)

// jobSpans is worker middleware that starts a span per job, as
// otelriver's does: caughtup's spans join it.
type jobSpans struct {
	river.MiddlewareDefaults
	tracer trace.Tracer
}

func (m *jobSpans) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	ctx, span := m.tracer.Start(ctx, "river.work "+job.Kind, trace.WithSpanKind(trace.SpanKindConsumer))
	defer span.End()
	return doInner(ctx)
}

// TestTraceSnooze: each snooze of a job no replica serves yet is a
// caughtup.defer span with the decision and the job, and each attempt's
// caughtup.route span records what was decided, the last on a replica;
// all of them children of the job's span.
func TestTraceSnooze(t *testing.T) {
	exp, tp := spantest.New(t)
	e := setup(t, func(c *consume.Config) {
		c.TracerProvider = tp
		c.WaitBudget = 50 * time.Millisecond
		c.DeferInitial = 200 * time.Millisecond
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, &jobSpans{tracer: tp.Tracer("app")}, e.middleware(t, caughtupriver.Config{TracerProvider: tp})), true)
	resume := e.pauseAll(t)
	res := e.insertTx(t, ctx, c, 1)

	spans := func(name string) []tracetest.SpanStub { return spantest.Named(exp, name) }
	require.Eventually(t, func() bool { return len(spans(consume.SpanDefer)) > 0 }, time.Minute, 20*time.Millisecond, "no snooze span")
	resume()
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)

	d := spans(consume.SpanDefer)[0]
	a := map[string]string{}
	for _, kv := range d.Attributes {
		a[string(kv.Key)] = kv.Value.Emit()
	}
	require.Equal(t, trace.SpanKindConsumer, d.SpanKind)
	require.Equal(t, "river", a["messaging.system"])
	require.Equal(t, "item", a["caughtup.river.kind"])
	require.Equal(t, strconv.FormatInt(res.Job.ID, 10), a["messaging.message.id"])
	require.Equal(t, "defer", a["caughtup.action"])
	require.Equal(t, "replica_behind", a["caughtup.reason"])

	routes := spans(consume.SpanRoute)
	require.GreaterOrEqual(t, len(routes), 2, "a route per attempt")
	var last map[string]string
	require.Eventually(t, func() bool {
		routes = spans(consume.SpanRoute)
		last = map[string]string{}
		for _, kv := range routes[len(routes)-1].Attributes {
			last[string(kv.Key)] = kv.Value.Emit()
		}
		return last["caughtup.action"] == "run"
	}, 10*time.Second, 10*time.Millisecond)
	require.Contains(t, []string{"replica", "replica_waited"}, last["caughtup.outcome"])
	// A job's span reaches the exporter when it ends, after the job's
	// run was recorded: the last one may still be open here.
	orphan := func() string {
		parents := map[trace.SpanID]bool{}
		for _, w := range spans("river.work item") {
			parents[w.SpanContext.SpanID()] = true
		}
		for _, s := range append(spans(consume.SpanRoute), spans(consume.SpanDefer)...) {
			if !parents[s.Parent.SpanID()] {
				return s.Name
			}
		}
		return ""
	}
	got := orphan()
	for deadline := time.Now().Add(10 * time.Second); got != "" && time.Now().Before(deadline); got = orphan() {
		time.Sleep(10 * time.Millisecond)
	}
	require.Empty(t, got, "a span that is not a child of a job's span")
}
