package caughtupkgo

import (
	"context"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// Producer stamps every record it produces with the token of the context
// it is produced with (enqueue.TokenFrom), then hands it to the wrapped
// franz-go client. It is the one-line change for a producer:
// caughtupkgo.NewProducer(cl).ProduceSync(ctx, r) where the code had
// cl.ProduceSync(ctx, r).
//
// franz-go's defaults already suit tokens: the sticky key partitioner
// keeps a key on one partition, acks are from all in-sync replicas and
// the producer is idempotent. Keep them: a record acknowledged with fewer
// acks can be lost, and a key spread over partitions has no order any
// consumer can keep.
type Producer struct {
	cl *kgo.Client
}

// NewProducer returns a Producer over cl. It does not take ownership of
// cl: close it yourself.
func NewProducer(cl *kgo.Client) *Producer { return &Producer{cl: cl} }

// Client returns the wrapped client.
func (p *Producer) Client() *kgo.Client { return p.cl }

// Produce stamps r (Stamp) and produces it as kgo.Client.Produce does. If
// r cannot be stamped it is not produced: promise, if not nil, is called
// at once with the error.
func (p *Producer) Produce(ctx context.Context, r *kgo.Record, promise func(*kgo.Record, error)) {
	if err := Stamp(ctx, r); err != nil {
		if promise != nil {
			promise(r, err)
		}
		return
	}
	p.cl.Produce(ctx, r, promise)
}

// ProduceSync stamps rs (Stamp) and produces them as
// kgo.Client.ProduceSync does. If one of them cannot be stamped, none is
// produced and every result carries that error.
func (p *Producer) ProduceSync(ctx context.Context, rs ...*kgo.Record) kgo.ProduceResults {
	for _, r := range rs {
		if err := Stamp(ctx, r); err != nil {
			out := make(kgo.ProduceResults, len(rs))
			for i, r := range rs {
				out[i] = kgo.ProduceResult{Record: r, Err: err}
			}
			return out
		}
	}
	return p.cl.ProduceSync(ctx, rs...)
}

// Stamp adds the token of ctx to r's headers in place, for code that
// produces through its own client. The rule is position.MergeHeader's, as
// for every stamper:
//
//   - r carries no token header: the context's token is added.
//   - r carries token headers that decode: they and the context's token
//     are merged into one header (the record then waits for all of them).
//   - one of them does not decode (malformed, or from a newer producer):
//     that header is kept as r's only token header and the context's
//     token is not added. Consumers read such a record from the primary,
//     which satisfies every token; unknown stays unknown.
//
// An error means the merged token cannot be carried (more than
// position.MaxDatabases databases, an invalid database name); r is then
// unchanged. Without a token or a trace context in ctx r is unchanged.
//
// Stamp replaces r.Headers with a new slice, so a header slice shared
// with other records is not modified.
//
// Stamp (and so Producer) also writes ctx's trace context into headers r
// does not have yet, through the global propagators
// (otel.SetTextMapPropagator; the default propagates nothing), so that the
// consumer's spans continue the producer's trace
// (ConsumerConfig.Propagators).
func Stamp(ctx context.Context, r *kgo.Record) error {
	if tok, ok := enqueue.TokenFrom(ctx); ok && !tok.IsZero() {
		hs, err := kafka.Stamped(r.Headers, tok, "")
		if err != nil {
			return fmt.Errorf("caughtup/kgo: stamping a record: %w", err)
		}
		r.Headers = hs
	}
	stampTrace(ctx, r)
	return nil
}

// TokenOf returns the token r carries, read with position.DecodeHeaders
// from every position.HeaderName header: the zero Token and nil when it
// carries none, the tokens of several headers merged, and the zero Token
// with a *position.DecodeError when any of them does not decode. Give both
// to consume.Router.Route (as Job.Token and Job.TokenErr), which sends a
// record whose token does not decode to the primary
// (ReasonMalformedToken); the Consumer does.
func TokenOf(r *kgo.Record) (position.Token, error) { return kafka.TokenOf(r.Headers) }
