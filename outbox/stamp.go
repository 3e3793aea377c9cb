package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// PublishFunc publishes one event; the shape of most hand-written relays'
// inner step, which Stamp decorates.
type PublishFunc func(ctx context.Context, event Event) error

// CaptureFunc returns a token for "now" on the primary.
type CaptureFunc func(ctx context.Context) (position.Token, error)

// StampOption configures Stamp.
type StampOption func(*stampOptions)

type stampOptions struct {
	capture  CaptureFunc
	required bool
}

// WithCapture captures a token on demand for events whose context carries
// none, typically CaptureFrom. That is only correct in a relay: code that
// publishes rows it has read as committed, so that a position read now is
// past their commits.
func WithCapture(f CaptureFunc) StampOption {
	return func(o *stampOptions) { o.capture = f }
}

// StampRequired makes Stamp fail the publish (with an error wrapping
// ErrNoToken) when it has no token, instead of publishing the event
// unstamped. Turn it on in the last migration step, once every path
// stamps.
func StampRequired() StampOption {
	return func(o *stampOptions) { o.required = true }
}

// ErrNoToken: Stamp had neither a token in the context nor a capture that
// worked, and StampRequired was set.
var ErrNoToken = errors.New("caughtup/outbox: no token to stamp (none in the context, no capture)")

// Stamp decorates an existing relay's publish step so that every event
// carries a token in Headers[position.HeaderName] (and its ID in
// HeaderEventID): the token in the context (enqueue.TokenFrom) when there
// is one, else one captured on demand (WithCapture). A token the event
// already carries is merged, not replaced.
//
// Without a token (no context token, no capture, or a failed capture) the
// event is published unstamped: consumers treat a missing token as
// unknown and read the primary, so stamping can be rolled out without ever
// blocking the relay. StampRequired changes that to an error.
func Stamp(next PublishFunc, opts ...StampOption) PublishFunc {
	var o stampOptions
	for _, f := range opts {
		if f != nil {
			f(&o)
		}
	}
	return func(ctx context.Context, ev Event) error {
		tok, ok := enqueue.TokenFrom(ctx)
		var captureErr error
		if !ok && o.capture != nil {
			if tok, captureErr = o.capture(ctx); captureErr == nil {
				ok = !tok.IsZero()
			}
		}
		if !ok {
			if o.required {
				if captureErr != nil {
					return fmt.Errorf("%w: %w", ErrNoToken, captureErr)
				}
				return ErrNoToken
			}
			return next(ctx, ev)
		}
		return next(ctx, stamp(ev, tok))
	}
}

// CaptureFrom returns a CaptureFunc that reads the primary's insert
// position and epoch on a connection from pool with capturer (one round
// trip).
func CaptureFrom(pool *pgxpool.Pool, capturer *enqueue.Capturer) CaptureFunc {
	return func(ctx context.Context) (position.Token, error) {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return position.Token{}, err
		}
		defer conn.Release()
		return capturer.Capture(ctx, conn.Conn())
	}
}
