package caughtuphttp

import (
	"bytes"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
)

func testKey(t testing.TB, id string) feed.Key {
	t.Helper()
	k, err := feed.GenerateKey(id)
	require.NoError(t, err)
	return k
}

var t0 = time.Date(2026, 12, 3, 9, 0, 0, 0, time.UTC)

func sampleToken() position.Token {
	return position.New("main", position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 2}, 0x16B3740, position.SourcePrimary, t0.Add(-time.Second)).
		With(position.Entry{Database: "billing", Epoch: position.Epoch{SystemID: 7, Timeline: 1}, LSN: 42, Source: position.SourceReplica}, t0)
}

func reason(t testing.TB, err error) Reason {
	t.Helper()
	require.Error(t, err)
	re, ok := err.(*RejectedError)
	require.True(t, ok, "%T %v", err, err)
	return re.Reason
}

func TestCodecRoundTrip(t *testing.T) {
	t.Parallel()
	c := newCodec([]feed.Key{testKey(t, "k1")}, 5*time.Second)
	tok := sampleToken()
	v, err := c.seal(tok, t0, 5*time.Minute)
	require.NoError(t, err)
	require.NotContains(t, v, ";", "the value must be a cookie value without quoting")
	o, err := c.open(v, t0.Add(time.Minute))
	require.NoError(t, err)
	require.Equal(t, tok.String(), o.tok.String())
	require.True(t, t0.Equal(o.issued), "issued %v", o.issued)
	require.Equal(t, 5*time.Minute, o.maxAge)
}

func TestCodecRotation(t *testing.T) {
	t.Parallel()
	old, next := testKey(t, "2026-11"), testKey(t, "2026-12")
	before := newCodec([]feed.Key{old}, time.Second)
	during := newCodec([]feed.Key{next, old}, time.Second)
	after := newCodec([]feed.Key{next}, time.Second)
	tok := sampleToken()

	v, err := before.seal(tok, t0, time.Hour)
	require.NoError(t, err)
	_, err = during.open(v, t0)
	require.NoError(t, err, "a value signed with the old key verifies while both are configured")
	require.Equal(t, ReasonUnknownKey, reason(t, func() error { _, err := after.open(v, t0); return err }()))

	v2, err := during.seal(tok, t0, time.Hour)
	require.NoError(t, err)
	_, err = after.open(v2, t0)
	require.NoError(t, err, "the first key signs")
	require.Equal(t, ReasonUnknownKey, reason(t, func() error { _, err := before.open(v2, t0); return err }()))

	// Another deployment's key under the same ID: a bad signature.
	other := newCodec([]feed.Key{testKey(t, "2026-12")}, time.Second)
	require.Equal(t, ReasonBadSignature, reason(t, func() error { _, err := other.open(v2, t0); return err }()))
}

func TestCodecExpiry(t *testing.T) {
	t.Parallel()
	c := newCodec([]feed.Key{testKey(t, "k")}, 5*time.Second)
	v, err := c.seal(sampleToken(), t0, time.Minute)
	require.NoError(t, err)
	_, err = c.open(v, t0.Add(time.Minute-time.Millisecond))
	require.NoError(t, err)
	require.Equal(t, ReasonExpired, reason(t, func() error { _, err := c.open(v, t0.Add(time.Minute)); return err }()))
	_, err = c.open(v, t0.Add(-5*time.Second))
	require.NoError(t, err, "issued within the clock skew tolerance ahead")
	require.Equal(t, ReasonFuture, reason(t, func() error { _, err := c.open(v, t0.Add(-5*time.Second-time.Millisecond)); return err }()))
}

// TestCodecTamper flips every byte of a value: each result is refused,
// and none panics.
func TestCodecTamper(t *testing.T) {
	t.Parallel()
	c := newCodec([]feed.Key{testKey(t, "k")}, time.Second)
	v, err := c.seal(sampleToken(), t0, time.Minute)
	require.NoError(t, err)
	for i := range len(v) {
		for _, repl := range []byte{'A', '_', '.', '%'} {
			if v[i] == repl {
				continue
			}
			b := []byte(v)
			b[i] = repl
			o, err := c.open(string(b), t0)
			if err == nil {
				// Base64's last character can carry unused bits: the
				// decoded bytes, and so the value, are then unchanged.
				require.Equal(t, sampleToken().String(), o.tok.String(), "byte %d → %q accepted with another token", i, repl)
				continue
			}
			require.NotEqual(t, Reason(0), reason(t, err))
		}
	}
	// A validly signed payload whose token does not decode.
	p := []byte{valueVersion, 1, 'k'}
	p = append(p, make([]byte, 12)...)
	p[len(p)-1] = 60
	p = append(p, "v9;nonsense"...)
	forged := base64.RawURLEncoding.EncodeToString(p) + "." + base64.RawURLEncoding.EncodeToString(mac(c.byID["k"], p))
	require.Equal(t, ReasonBadToken, reason(t, func() error { _, err := c.open(forged, time.UnixMilli(0)); return err }()))
}

func TestCodecMalformed(t *testing.T) {
	t.Parallel()
	c := newCodec([]feed.Key{testKey(t, "k")}, time.Second)
	for _, v := range []string{"x", ".", "a.b", "!!.!!", strings.Repeat("A", maxValue+1), "AQFr." + strings.Repeat("A", 43)} {
		require.Equal(t, ReasonMalformed, reason(t, func() error { _, err := c.open(v, t0); return err }()), "%q", v)
	}
}

func FuzzOpen(f *testing.F) {
	key := feed.Key{ID: "fuzz", Secret: bytes.Repeat([]byte{7}, 32)}
	c := newCodec([]feed.Key{key}, time.Second)
	v, err := c.seal(sampleToken(), t0, time.Minute)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(v)
	f.Add("")
	f.Add(".")
	f.Add(v[:len(v)/2])
	f.Add(strings.Replace(v, ".", "..", 1))
	f.Fuzz(func(t *testing.T, value string) {
		o, err := c.open(value, t0)
		// What open remembers changes nothing: the value's verification
		// again, at that time and at others, gives what verify gives.
		for _, now := range []time.Time{t0, t0, t0.Add(-2 * time.Second), t0.Add(time.Minute)} {
			o2, err2 := c.open(value, now)
			w, werr := c.verify(value, now)
			if (err2 == nil) != (werr == nil) || (err2 != nil && reason(t, err2) != reason(t, werr)) ||
				(err2 == nil && (o2.tok.String() != w.tok.String() || !o2.issued.Equal(w.issued) || o2.maxAge != w.maxAge)) {
				t.Fatalf("at %v: open %+v, %v; verify %+v, %v", now, o2, err2, w, werr)
			}
		}
		if err != nil {
			if _, ok := err.(*RejectedError); !ok {
				t.Fatalf("open returned %T, want *RejectedError", err)
			}
			return
		}
		// Anything accepted carries a token that encodes again.
		if _, err := o.tok.Encode(); err != nil {
			t.Fatalf("accepted a value whose token does not encode: %v", err)
		}
	})
}

// TestCodecVerifiedValues: a value that verified is not verified again,
// but its age is checked at every open; values that did not verify, or
// differ from one that did in any byte, are verified in full.
func TestCodecVerifiedValues(t *testing.T) {
	t.Parallel()
	c := newCodec([]feed.Key{testKey(t, "k")}, 5*time.Second)
	tok := sampleToken()
	v, err := c.seal(tok, t0, time.Minute)
	require.NoError(t, err)
	_, known := c.verified.lookup(v)
	require.False(t, known, "sealing remembers nothing")
	o, err := c.open(v, t0)
	require.NoError(t, err)
	cached, known := c.verified.lookup(v)
	require.True(t, known, "a verified value is remembered")
	require.Equal(t, o, cached)
	require.Equal(t, tok.String(), cached.tok.String())

	// Its age is checked again on every open.
	_, err = c.open(v, t0.Add(time.Minute-time.Millisecond))
	require.NoError(t, err)
	require.Equal(t, ReasonExpired, reason(t, func() error { _, err := c.open(v, t0.Add(time.Minute)); return err }()))
	require.Equal(t, ReasonFuture, reason(t, func() error { _, err := c.open(v, t0.Add(-5*time.Second-time.Millisecond)); return err }()))
	_, err = c.open(v, t0.Add(time.Second))
	require.NoError(t, err, "an expired open does not forget a value that a later request may still carry within its age")

	// A byte changed is another value: verified, and refused.
	b := []byte(v)
	b[len(b)/3] ^= 1
	require.Equal(t, ReasonBadSignature, reason(t, func() error { _, err := c.open(string(b), t0); return err }()))
	_, known = c.verified.lookup(string(b))
	require.False(t, known, "a refused value is not remembered")
	// A value expired at its first open is not remembered either.
	old, err := c.seal(tok, t0.Add(-time.Hour), time.Minute)
	require.NoError(t, err)
	require.Equal(t, ReasonExpired, reason(t, func() error { _, err := c.open(old, t0); return err }()))
	_, known = c.verified.lookup(old)
	require.False(t, known)

	// Another codec (another key under the same ID) shares nothing.
	other := newCodec([]feed.Key{testKey(t, "k")}, 5*time.Second)
	require.Equal(t, ReasonBadSignature, reason(t, func() error { _, err := other.open(v, t0); return err }()))

	// Bounded: every value takes one slot, the newest in a slot wins.
	for i := range 3 * verifiedSlots {
		v, err := c.seal(tok, t0.Add(time.Duration(i)*time.Millisecond), time.Minute)
		require.NoError(t, err)
		_, err = c.open(v, t0.Add(20*time.Second))
		require.NoError(t, err)
	}
	n := 0
	for i := range c.verified.slots {
		if c.verified.slots[i].Load() != nil {
			n++
		}
	}
	require.LessOrEqual(t, n, verifiedSlots)
	_, err = c.open(v, t0)
	require.NoError(t, err, "a value whose slot was taken is verified again")
}
