package spantest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
)

func TestNamedAndAttrs(t *testing.T) {
	t.Parallel()
	exp, tp := New(t)
	tr := tp.Tracer("test")
	_, a := tr.Start(context.Background(), "a")
	a.SetAttributes(attribute.String("k", "v"), attribute.Int("n", 2))
	a.End()
	_, b := tr.Start(context.Background(), "b")
	b.End()
	_, a2 := tr.Start(context.Background(), "a")
	a2.End()
	as := Named(exp, "a")
	require.Len(t, as, 2)
	require.Equal(t, "v", Attrs(as[0])["k"].AsString())
	require.Equal(t, int64(2), Attrs(as[0])["n"].AsInt64())
	require.Empty(t, Named(exp, "c"))
}
