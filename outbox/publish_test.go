package outbox

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

var testEpoch = position.Epoch{SystemID: 7, Timeline: 1}

func tokenFor(database string, lsn position.LSN) position.Token {
	return position.New(database, testEpoch, lsn, position.SourcePrimary, time.UnixMilli(1700000000000))
}

func encoded(t *testing.T, tok position.Token) string {
	t.Helper()
	s, err := tok.Encode()
	require.NoError(t, err)
	return s
}

// fullToken names position.MaxDatabases databases, none of them "main":
// no further database fits.
func fullToken() position.Token {
	var tok position.Token
	for i := range position.MaxDatabases {
		tok = tok.Merge(tokenFor(fmt.Sprintf("db%d", i), 0x10))
	}
	return tok
}

// TestStamperHeaderRule: relays stamp through position.MergeHeader, the
// one header rule of every caughtup stamper.
func TestStamperHeaderRule(t *testing.T) {
	t.Parallel()
	ours := tokenFor("main", 0x200)
	const malformed = "v1;main@not-a-token"
	tests := []struct {
		name       string
		existing   string // "" for no header
		wantHeader string // "" for no header
		wantToken  position.Token
		wantErr    bool
	}{
		{name: "no header", wantHeader: encoded(t, ours), wantToken: ours},
		{name: "another database's token is kept",
			existing:   encoded(t, tokenFor("billing", 0x100)),
			wantHeader: encoded(t, ours.Merge(tokenFor("billing", 0x100))),
			wantToken:  ours.Merge(tokenFor("billing", 0x100))},
		{name: "same database: the later position wins",
			existing:   encoded(t, tokenFor("main", 0x300)),
			wantHeader: encoded(t, tokenFor("main", 0x300)),
			wantToken:  tokenFor("main", 0x300)},
		// Unknown stays unknown: the consumer reads the primary, which
		// satisfies our position too. (Before this rule the relays dropped
		// the header and sent ours alone.)
		{name: "malformed header stays as it is", existing: malformed, wantHeader: malformed},
		// Too many databases to carry: the producer's header goes out
		// unchanged; it lacks "main", so consumers read main's primary.
		{name: "merge too large", existing: encoded(t, fullToken()), wantHeader: encoded(t, fullToken()), wantToken: fullToken(), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := map[string]string{"x": "1"}
			if tt.existing != "" {
				in[position.HeaderName] = tt.existing
			}
			before := fmt.Sprint(in)
			ev, err := newStamper(ours).stamp(Event{ID: "e1", Topic: "t", Headers: in})
			require.Equal(t, tt.wantErr, err != nil, "%v", err)
			require.Equal(t, before, fmt.Sprint(in), "the caller's headers are not modified")
			require.Equal(t, "1", ev.Headers["x"])
			require.Equal(t, "e1", ev.Headers[HeaderEventID])
			require.Equal(t, tt.wantHeader, ev.Headers[position.HeaderName])
			require.Equal(t, tt.wantToken.Entries, ev.Token.Entries)
			got, derr := TokenFromHeaders(ev.Headers)
			if tt.existing == malformed {
				var de *position.DecodeError
				require.ErrorAs(t, derr, &de, "a consumer sees the malformed header and reads the primary")
				return
			}
			require.NoError(t, derr)
			require.Equal(t, ev.Token.Entries, got.Entries, "Token is what the header carries")
		})
	}
}

func TestTokenFromHeaders(t *testing.T) {
	t.Parallel()
	tok, err := TokenFromHeaders(nil)
	require.NoError(t, err)
	require.True(t, tok.IsZero(), "no header: no token, no error")
	tok, err = TokenFromHeaders(map[string]string{position.HeaderName: ""})
	require.NoError(t, err)
	require.True(t, tok.IsZero())
	want := tokenFor("main", 0x16B3740)
	tok, err = TokenFromHeaders(map[string]string{position.HeaderName: encoded(t, want)})
	require.NoError(t, err)
	require.Equal(t, want.Entries, tok.Entries)
	_, err = TokenFromHeaders(map[string]string{position.HeaderName: "garbage"})
	var de *position.DecodeError
	require.ErrorAs(t, err, &de)
}

func TestStamping(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []Event
	next := func(_ context.Context, ev Event) error { got = append(got, ev); return nil }
	stamping := func(cfg StampingConfig) PublishFunc {
		t.Helper()
		f, err := Stamping(next, cfg)
		require.NoError(t, err)
		return f
	}

	// A token in the context wins and needs no database.
	ctxTok := tokenFor("main", 0x100)
	require.NoError(t, stamping(StampingConfig{})(enqueue.WithToken(ctx, ctxTok), Event{ID: "a", Topic: "t"}))
	require.Equal(t, ctxTok.Entries, got[0].Token.Entries)
	require.Equal(t, "a", got[0].Headers[HeaderEventID])

	// No token, no capture: published unstamped (consumers read the
	// primary); Required refuses instead.
	require.NoError(t, stamping(StampingConfig{})(ctx, Event{ID: "b", Topic: "t"}))
	require.NotContains(t, got[1].Headers, position.HeaderName)
	require.ErrorIs(t, stamping(StampingConfig{Required: true})(ctx, Event{ID: "c"}), ErrNoToken)
	boom := errors.New("boom")
	failing := func(context.Context) (position.Token, error) { return position.Token{}, boom }
	err := stamping(StampingConfig{Required: true, Capture: failing})(ctx, Event{ID: "c"})
	require.ErrorIs(t, err, ErrNoToken)
	require.ErrorIs(t, err, boom)
	require.Len(t, got, 2)

	// Captured on demand, after the row was committed: at or past its
	// commit, and merged with the token the event already had.
	_, after, err := e.writeOrder(ctx, 1)
	require.NoError(t, err)
	legacy := stamping(StampingConfig{Primary: e.Primary})
	other := encoded(t, tokenFor("billing", 5))
	require.NoError(t, legacy(ctx, Event{ID: "d", Topic: "t", Headers: map[string]string{position.HeaderName: other}}))
	tok, err := TokenFromHeaders(got[2].Headers)
	require.NoError(t, err)
	main, ok := tok.Entry("main")
	require.True(t, ok)
	require.GreaterOrEqual(t, main.LSN, after)
	_, ok = tok.Entry("billing")
	require.True(t, ok)

	// The one header rule: a malformed header stays malformed.
	require.NoError(t, legacy(ctx, Event{ID: "e", Topic: "t", Headers: map[string]string{position.HeaderName: "v1;broken"}}))
	require.Equal(t, "v1;broken", got[3].Headers[position.HeaderName])

	// A header that cannot take the token: unchanged without Required,
	// an error at the call with it.
	full := encoded(t, fullToken())
	require.NoError(t, legacy(ctx, Event{ID: "f", Topic: "t", Headers: map[string]string{position.HeaderName: full}}))
	require.Equal(t, full, got[4].Headers[position.HeaderName])
	err = stamping(StampingConfig{Primary: e.Primary, Required: true})(ctx, Event{ID: "g", Topic: "t", Headers: map[string]string{position.HeaderName: full}})
	require.ErrorIs(t, err, position.ErrTooLarge)
	require.Len(t, got, 5)
}
