package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// PublishFunc publishes one event: the shape of most hand-written relays'
// inner step, which Stamping decorates.
type PublishFunc func(ctx context.Context, event Event) error

// CaptureFunc returns a token for "now" on the primary.
type CaptureFunc func(ctx context.Context) (position.Token, error)

// StampingConfig configures Stamping. The zero value is valid: it stamps
// events whose context carries a token and publishes the others
// unstamped.
type StampingConfig struct {
	// Primary captures a token on demand (one round trip on a connection
	// from the pool) for events whose context carries none.
	// Default: nil, no capture.
	// Only a relay may set it: it publishes rows already read as
	// committed, so a position read afterwards is past their commits.
	Primary *pgxpool.Pool
	// Database is the logical database name of captured tokens; used only
	// with Primary.
	// Default: DefaultDatabase ("main").
	Database string
	// Capture captures on demand instead of Primary (a Capturer shared with
	// other code, another kind of pool); set at most one of the two.
	// Default: nil.
	// The same rule as Primary's applies: call it only after the rows were read.
	Capture CaptureFunc
	// Required fails the publish (an error wrapping ErrNoToken) when there
	// is no token, or when it cannot be merged into the event's header,
	// instead of publishing the event unstamped.
	// Default: false.
	// Stamping can then be rolled out without blocking the relay; turn it
	// on in the last migration step (MIGRATING.md).
	Required bool
}

// WithDefaults returns c with every zero field set to its default.
func (c StampingConfig) WithDefaults() StampingConfig {
	if c.Database == "" {
		c.Database = DefaultDatabase
	}
	return c
}

// Validate reports a config Stamping would reject.
func (c StampingConfig) Validate() error {
	c = c.WithDefaults()
	if c.Primary != nil && c.Capture != nil {
		return invalid("StampingConfig: both Primary and Capture are set: keep one")
	}
	return validDatabase("StampingConfig", c.Database)
}

// ErrNoToken: a Stamping step with Required set had neither a token in the
// context nor a capture that worked.
var ErrNoToken = errors.New("caughtup/outbox: no token to stamp (none in the context, no capture)")

// Stamping decorates an existing relay's publish step so that every event
// carries a token in Headers[position.HeaderName] (and its ID in
// HeaderEventID): the token in the context (enqueue.TokenFrom) when there
// is one, else one captured on demand (StampingConfig.Primary or Capture).
// A token the event already carries is merged by the one header rule,
// position.MergeHeader, as the relays of this package merge: entries for
// other databases are kept, and a header that does not decode is left as
// it is, so the consumer reads the primary.
//
// Without a token (no context token, no capture, or a failed capture) the
// event is published unstamped: consumers treat a missing token as
// unknown and read the primary, so stamping can be rolled out without ever
// blocking the relay. StampingConfig.Required changes that to an error.
func Stamping(next PublishFunc, cfg StampingConfig) (PublishFunc, error) {
	if next == nil {
		return nil, invalid("Stamping: next is nil: give the publish step to decorate")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	capture := cfg.Capture
	if cfg.Primary != nil {
		capture = captureFrom(cfg.Primary, enqueue.NewCapturer(enqueue.Config{Database: cfg.Database}))
	}
	required := cfg.Required
	return func(ctx context.Context, ev Event) error {
		tok, ok := enqueue.TokenFrom(ctx)
		var captureErr error
		if !ok && capture != nil {
			if tok, captureErr = capture(ctx); captureErr == nil {
				ok = !tok.IsZero()
			}
		}
		if !ok {
			if required {
				if captureErr != nil {
					return fmt.Errorf("%w: %w", ErrNoToken, captureErr)
				}
				return ErrNoToken
			}
			return next(ctx, ev)
		}
		stamped, err := newStamper(tok).stamp(ev)
		if err != nil && required {
			return fmt.Errorf("caughtup/outbox: stamping event %s: %w", ev.ID, err)
		}
		// Without Required, an event whose header cannot take the token
		// goes out with its header unchanged, which lacks this database:
		// consumers read its primary.
		return next(ctx, stamped)
	}, nil
}

// captureFrom reads the primary's insert position and epoch on a
// connection from pool with capturer (one round trip).
func captureFrom(pool *pgxpool.Pool, capturer *enqueue.Capturer) CaptureFunc {
	return func(ctx context.Context) (position.Token, error) {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return position.Token{}, err
		}
		defer conn.Release()
		return capturer.Capture(ctx, conn.Conn())
	}
}
