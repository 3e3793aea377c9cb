package caughtupriver_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

// TestTraceSnooze: each snooze of a job no replica serves yet is a
// caughtup.defer span with the decision and the job, and each attempt's
// caughtup.route span records what was decided, the last on a replica.
func TestTraceSnooze(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	e := setup(t, func(c *consume.Config) {
		c.TracerProvider = tp
		c.WaitBudget = 50 * time.Millisecond
		c.DeferInitial = 200 * time.Millisecond
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{TracerProvider: tp})), true)
	resume := e.pauseAll(t)
	res := e.insertTx(t, ctx, c, 1)

	spans := func(name string) []tracetest.SpanStub {
		var out []tracetest.SpanStub
		for _, s := range exp.GetSpans() {
			if s.Name == name {
				out = append(out, s)
			}
		}
		return out
	}
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
}
