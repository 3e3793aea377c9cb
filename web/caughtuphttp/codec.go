package caughtuphttp

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/sign"
)

// The signed value a cookie (or Config.Header) carries:
//
//	base64url(payload) "." base64url(MAC of payload, package sign's scheme under the domain "caughtup/http/v1")
//
// payload, in bytes:
//
//	1          version (valueVersion)
//	1          n, the length of the key ID
//	n          the ID of the key that signed it (sign.Key.ID)
//	8          issued at, Unix milliseconds, big-endian
//	4          max age in seconds, big-endian
//	rest       the token, position's text form (Token.Encode)
//
// The key ID says which of the configured keys verifies the value, so that
// a value signed by a key this process does not have is told apart from
// one that was altered. Issued-at and max age are signed with the token:
// neither can be stretched by the client, whatever its cookie store does.
// Only base64url characters and one '.' appear, all valid in a cookie
// value and a header value without quoting.
const (
	valueVersion = 1
	macSize      = sign.Size
	// maxPayload bounds what open decodes: a token at position's limit
	// with the longest key ID. Anything longer is malformed.
	maxPayload = 2 + sign.MaxKeyIDLen + 8 + 4 + position.MaxEncodedLen
	maxValue   = (maxPayload*4+2)/3 + 1 + (macSize*4+2)/3
)

var b64 = base64.RawURLEncoding

// scheme signs session values. Its domain starts every MAC input, so that
// no other use of a key (the position feed's messages, say) produces a
// valid session value.
var scheme = sign.NewScheme("caughtup/http/v1")

// mac is payload's MAC under secret.
func mac(secret, payload []byte) []byte { return scheme.Sum(secret, payload) }

// Reason says why a session value was not believed, as the caughtup.reason
// attribute of caughtup.http.tokens.rejected and in the warning logged.
type Reason uint8

const (
	// ReasonMalformed: not a value this package writes (bad base64, wrong
	// length, unknown version).
	ReasonMalformed Reason = iota + 1
	// ReasonUnknownKey: signed with a key ID none of Config.Keys has: a key
	// retired too early, or another deployment's value.
	ReasonUnknownKey
	// ReasonBadSignature: the signature does not verify under the named
	// key: altered, or signed by another secret under the same ID.
	ReasonBadSignature
	// ReasonExpired: older than the max age it was issued with.
	ReasonExpired
	// ReasonFuture: issued further ahead of this process's clock than the
	// router's ClockSkewTolerance.
	ReasonFuture
	// ReasonBadToken: the signature verifies but the token inside does not
	// decode (position.Decode), e.g. one written by a newer caughtup.
	ReasonBadToken
	// ReasonOtherCluster: the token verifies and decodes, but names a
	// position of another cluster (another system identifier, or an epoch
	// made unknown by merging two): that database read the primary (or,
	// past the fallback cap, read as without a session), and the next
	// value the client gets leaves it out.
	ReasonOtherCluster

	numReasons = int(ReasonOtherCluster) + 1
)

var reasonNames = [numReasons]string{
	ReasonMalformed:    "malformed",
	ReasonUnknownKey:   "unknown_key",
	ReasonBadSignature: "bad_signature",
	ReasonExpired:      "expired",
	ReasonFuture:       "issued_in_future",
	ReasonBadToken:     "bad_token",
	ReasonOtherCluster: "other_cluster",
}

// String is the reason's name in metrics and logs ("expired", …).
func (r Reason) String() string {
	if r > 0 && int(r) < numReasons {
		return reasonNames[r]
	}
	return "Reason(" + strconv.Itoa(int(r)) + ")"
}

// RejectedError is why a session value was ignored; the request then reads
// the primary, charged to the router's fallback cap, or past the cap as a
// request without a session. Detail never holds the value itself.
type RejectedError struct {
	Reason Reason
	Detail string
}

func (e *RejectedError) Error() string {
	if e.Detail == "" {
		return "caughtup/http: session token ignored (" + e.Reason.String() + ")"
	}
	return "caughtup/http: session token ignored (" + e.Reason.String() + "): " + e.Detail
}

func reject(r Reason, format string, args ...any) *RejectedError {
	return &RejectedError{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

// codec seals and opens session values with a list of keys: the first
// signs, all verify. Its keys never change, and it is safe for concurrent
// use. Each seal makes its own HMAC state (sign.Scheme.Sum); open
// remembers the values it verified (verified), since a session sends the
// same value with every request until it writes again.
type codec struct {
	signer sign.Key
	byID   map[string][]byte
	// skew is how far ahead of now an issued-at may be.
	skew time.Duration

	verified *verifiedValues
}

func newCodec(keys []sign.Key, skew time.Duration) *codec {
	c := &codec{signer: keys[0], byID: make(map[string][]byte, len(keys)), skew: skew, verified: newVerifiedValues()}
	for _, k := range keys {
		c.byID[k.ID] = append([]byte(nil), k.Secret...)
	}
	c.signer.Secret = c.byID[keys[0].ID]
	return c
}

// verifiedValues remembers, by their exact text, values whose signature
// verified under this codec's keys and whose token decoded, with what
// they carry: verifying and decoding cost about a microsecond and a dozen
// allocations, which a session would otherwise pay on every request.
// The MAC is over the very bytes the text decodes to, and the keys never
// change, so the same text verifies the same way every time; what depends
// on the clock (expired, issued in the future) is checked again on every
// open (codec.current). Only values that verified are kept: a client
// cannot fill it without values this process signed, and a value that
// failed is verified again, as before.
//
// It holds verifiedSlots entries, one per slot: a value's slot is a hash
// of its text under a seed of this process (maphash), so a client cannot
// choose whose entry its value replaces, and a newer value replaces the
// older. Memory is bounded by verifiedSlots values (a value is at most
// maxValue bytes).
type verifiedValues struct {
	seed  maphash.Seed
	slots [verifiedSlots]atomic.Pointer[verifiedValue]
}

// verifiedSlots: a power of two, for the slot mask; enough for the
// sessions that are active at once in one process in most deployments.
// More sessions than that only cost more verification.
const verifiedSlots = 4096

type verifiedValue struct {
	hash  uint64
	value string
	o     opened
}

func newVerifiedValues() *verifiedValues { return &verifiedValues{seed: maphash.MakeSeed()} }

func (v *verifiedValues) slot(hash uint64) *atomic.Pointer[verifiedValue] {
	return &v.slots[hash&(verifiedSlots-1)]
}

// lookup returns what value carries if it verified before.
func (v *verifiedValues) lookup(value string) (opened, bool) {
	h := maphash.String(v.seed, value)
	e := v.slot(h).Load()
	// The hash first (under a secret seed, it says nothing about the
	// texts), then the texts in constant time: a client's guess learns
	// nothing from how long a comparison with another session's value
	// took.
	if e == nil || e.hash != h || !sameText(e.value, value) {
		return opened{}, false
	}
	return e.o, true
}

// sameText reports whether a and b are equal, in a time that depends on
// their lengths only.
func sameText(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	var diff byte
	for i := 0; i < len(a); i++ {
		diff |= a[i] ^ b[i]
	}
	return diff == 0
}

// remember records that value verified and carries o.
func (v *verifiedValues) remember(value string, o opened) {
	h := maphash.String(v.seed, value)
	// A copy: value may be a slice of a request's whole Cookie header.
	v.slot(h).Store(&verifiedValue{hash: h, value: strings.Clone(value), o: o})
}

// seal returns the signed value carrying tok, issued at issued with maxAge.
func (c *codec) seal(tok position.Token, issued time.Time, maxAge time.Duration) (string, error) {
	text, err := tok.Encode()
	if err != nil {
		return "", err
	}
	id := c.signer.ID
	p := make([]byte, 0, 2+len(id)+12+len(text))
	p = append(p, valueVersion, byte(len(id)))
	p = append(p, id...)
	p = binary.BigEndian.AppendUint64(p, uint64(issued.UnixMilli()))
	p = binary.BigEndian.AppendUint32(p, uint32(min(maxAge/time.Second, 1<<32-1)))
	p = append(p, text...)
	var b strings.Builder
	b.Grow(b64.EncodedLen(len(p)) + 1 + b64.EncodedLen(macSize))
	b.WriteString(b64.EncodeToString(p))
	b.WriteByte('.')
	b.WriteString(b64.EncodeToString(mac(c.signer.Secret, p)))
	return b.String(), nil
}

// opened is what a verified value carries.
type opened struct {
	tok    position.Token
	issued time.Time
	maxAge time.Duration
}

// open verifies value at now. Every failure is a *RejectedError; nothing
// in value can make it panic (FuzzOpen). A value that verified before is
// not verified again (verifiedValues); its age is.
func (c *codec) open(value string, now time.Time) (opened, error) {
	if o, ok := c.verified.lookup(value); ok {
		if re := c.current(o, now); re != nil {
			return opened{}, re
		}
		return o, nil
	}
	o, err := c.verify(value, now)
	if err == nil {
		c.verified.remember(value, o)
	}
	return o, err
}

// current checks a verified value's age at now.
func (c *codec) current(o opened, now time.Time) *RejectedError {
	switch {
	case o.issued.After(now.Add(c.skew)):
		return reject(ReasonFuture, "issued %v ahead", o.issued.Sub(now).Round(time.Millisecond))
	case !now.Before(o.issued.Add(o.maxAge)):
		return reject(ReasonExpired, "issued %v ago with max age %v", now.Sub(o.issued).Round(time.Second), o.maxAge)
	}
	return nil
}

// verify is open without verifiedValues: the signature, the age and the
// token, in that order.
func (c *codec) verify(value string, now time.Time) (opened, error) {
	if len(value) > maxValue {
		return opened{}, reject(ReasonMalformed, "%d bytes, more than %d", len(value), maxValue)
	}
	enc, sigEnc, ok := strings.Cut(value, ".")
	if !ok {
		return opened{}, reject(ReasonMalformed, "no signature")
	}
	p, err := b64.DecodeString(enc)
	if err != nil {
		return opened{}, reject(ReasonMalformed, "payload is not base64url")
	}
	sig, err := b64.DecodeString(sigEnc)
	if err != nil || len(sig) != macSize {
		return opened{}, reject(ReasonMalformed, "signature is not %d bytes of base64url", macSize)
	}
	if len(p) < 2 || p[0] != valueVersion {
		return opened{}, reject(ReasonMalformed, "unknown version")
	}
	n := int(p[1])
	if len(p) < 2+n+12 {
		return opened{}, reject(ReasonMalformed, "payload too short")
	}
	id := string(p[2 : 2+n])
	secret, known := c.byID[id]
	if !known {
		// The ID is printed quoted and cut: it is the client's text.
		return opened{}, reject(ReasonUnknownKey, "key %.16q", id)
	}
	if !scheme.Verify(secret, p, sig) {
		return opened{}, reject(ReasonBadSignature, "key %q", id)
	}
	rest := p[2+n:]
	o := opened{
		issued: time.UnixMilli(int64(binary.BigEndian.Uint64(rest))),
		maxAge: time.Duration(binary.BigEndian.Uint32(rest[8:])) * time.Second,
	}
	if re := c.current(o, now); re != nil {
		return opened{}, re
	}
	if o.tok, err = position.Decode(string(rest[12:])); err != nil {
		return opened{}, &RejectedError{Reason: ReasonBadToken, Detail: err.Error()}
	}
	return o, nil
}

// asRejected returns err's *RejectedError, for callers of open.
func asRejected(err error) *RejectedError {
	var re *RejectedError
	if errors.As(err, &re) {
		return re
	}
	return &RejectedError{Reason: ReasonMalformed, Detail: err.Error()}
}
