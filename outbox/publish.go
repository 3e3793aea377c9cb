package outbox

import (
	"context"
	"maps"

	"github.com/caughtup/caughtup/position"
)

// Publisher delivers a batch of stamped events. Relays call it with the
// events of one batch in Seq order and mark the batch done only when it
// returns nil, so Publish must return nil only once every event is
// durably accepted by the broker. An error makes the relay publish the
// whole batch again later: duplicates, never loss. The relay reuses the
// slice after Publish returns; copy events that must outlive the call.
//
// The kafka and asynq adapters provide one each
// (caughtupkafka.NewOutboxPublisher, caughtupasynq.NewOutboxPublisher);
// this package imports no queue library.
type Publisher interface {
	Publish(ctx context.Context, events []Event) error
}

// PublisherFunc adapts a function to Publisher.
type PublisherFunc func(ctx context.Context, events []Event) error

// Publish calls f.
func (f PublisherFunc) Publish(ctx context.Context, events []Event) error { return f(ctx, events) }

var _ Publisher = PublisherFunc(nil)

// stamper stamps the events of one batch with one token, encoded once.
type stamper struct {
	tok position.Token
	enc string
	err error
}

func newStamper(tok position.Token) stamper {
	enc, err := tok.Encode()
	return stamper{tok: tok, enc: enc, err: err}
}

// stamp returns ev with the token merged into its headers by the one
// header rule, position.MergeHeader, and HeaderEventID set. The headers
// map is copied: the caller's event, and a retried batch, are never
// changed in place.
//
// A producer that also read or wrote other databases may have stamped the
// event already: its entries are kept. A producer header that does not
// decode stays as it is (Token zero): unknown stays unknown, and the
// consumer reads the primary, which satisfies our position too. When the
// merge cannot be carried (more than position.MaxDatabases databases),
// stamp returns the error and the event with its header unchanged, which
// lacks this database and so makes consumers read its primary.
func (s stamper) stamp(ev Event) (Event, error) {
	h := make(map[string]string, len(ev.Headers)+2)
	maps.Copy(h, ev.Headers)
	if ev.ID != "" {
		h[HeaderEventID] = ev.ID
	}
	ev.Headers = h
	existing := h[position.HeaderName]
	if existing == "" {
		if s.err != nil {
			return ev, s.err
		}
		if s.enc == "" {
			delete(h, position.HeaderName)
		} else {
			h[position.HeaderName] = s.enc
		}
		ev.Token = s.tok
		return ev, nil
	}
	merged, err := position.MergeHeader(existing, s.tok)
	if err != nil {
		ev.Token, _ = position.DecodeHeaders(existing)
		return ev, err
	}
	h[position.HeaderName] = merged
	ev.Token, _ = position.DecodeHeaders(merged)
	return ev, nil
}

// TokenFromHeaders returns the token a relay of this package stamped on a
// message, read with the header codec (position.DecodeHeaders): an
// ordinary caughtup token in position.HeaderName, compared like any other
// (consume.Job takes the pair as Token and TokenErr). A missing header
// returns the zero Token and no error, and a malformed one the zero Token
// and a *position.DecodeError; consumers treat both as unknown and read
// the primary.
func TokenFromHeaders(h map[string]string) (position.Token, error) {
	return position.DecodeHeaders(h[position.HeaderName])
}
