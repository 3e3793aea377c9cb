package sign

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"strings"
)

// MinSecretLen is the shortest Key.Secret accepted: 32 random bytes, the
// HMAC-SHA256 block's worth of security.
const MinSecretLen = 32

// MaxKeyIDLen bounds a key ID: it travels in every signed value.
const MaxKeyIDLen = 64

// Size is the length of a MAC.
const Size = sha256.Size

// ErrInvalidKey is wrapped by every error about a key or a keyring.
var ErrInvalidKey = errors.New("caughtup/sign: invalid key")

// Key is one shared secret that signers sign with and verifiers verify
// with. Its ID travels with every signed value (it is not secret), so that
// a verifier knows which of its keys to verify with.
type Key struct {
	// ID names the key: 1–64 characters from A–Z a–z 0–9 . _ -, e.g.
	// "2025-06". Unique within a Keyring.
	ID string
	// Secret is at least MinSecretLen bytes, from a cryptographic random
	// source (GenerateKey). Never logged: String redacts it.
	Secret []byte
}

// GenerateKey returns a key with a fresh 32-byte random secret.
func GenerateKey(id string) (Key, error) {
	if err := CheckKeyID(id); err != nil {
		return Key{}, err
	}
	k := Key{ID: id, Secret: make([]byte, MinSecretLen)}
	_, _ = rand.Read(k.Secret) // never fails (crypto/rand)
	return k, nil
}

// ParseKeys reads keys written as "id:base64secret", several separated by
// commas, as Export writes them: the form to keep in a secret store and
// pass through an environment variable. Standard or URL base64, padded or
// not.
func ParseKeys(text string) ([]Key, error) {
	var keys []Key
	for part := range strings.SplitSeq(text, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		id, enc, ok := strings.Cut(part, ":")
		if !ok {
			return nil, fmt.Errorf("%w: a key is written \"id:base64secret\"; got one without ':' (id %q)", ErrInvalidKey, redactID(part))
		}
		secret, err := decodeSecret(enc)
		if err != nil {
			return nil, fmt.Errorf("%w: key %q: the secret is not base64", ErrInvalidKey, id)
		}
		k := Key{ID: id, Secret: secret}
		if err := k.Validate(); err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, nil
}

func redactID(s string) string {
	if len(s) > 8 {
		return s[:8] + "…"
	}
	return s
}

func decodeSecret(s string) ([]byte, error) {
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil {
			return b, nil
		}
	}
	return nil, errors.New("not base64")
}

// Export writes the key as ParseKeys reads it, secret included.
func (k Key) Export() string {
	return k.ID + ":" + base64.StdEncoding.EncodeToString(k.Secret)
}

// String names the key without its secret, so that logging a config does
// not leak it.
func (k Key) String() string { return "sign.Key{ID: " + k.ID + ", Secret: [redacted]}" }

// GoString is String, for %#v.
func (k Key) GoString() string { return k.String() }

// Validate checks the key's ID and the length of its secret; its errors
// wrap ErrInvalidKey.
func (k Key) Validate() error {
	if err := CheckKeyID(k.ID); err != nil {
		return err
	}
	if len(k.Secret) < MinSecretLen {
		return fmt.Errorf("%w: key %q has a %d-byte secret; use at least %d random bytes (GenerateKey)", ErrInvalidKey, k.ID, len(k.Secret), MinSecretLen)
	}
	return nil
}

// CheckKeyID accepts 1..MaxKeyIDLen bytes of [A-Za-z0-9._-]: an ID goes
// into signed values, logs and, for the feed, Redis key names. Its errors
// wrap ErrInvalidKey.
func CheckKeyID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty key ID", ErrInvalidKey)
	}
	if len(id) > MaxKeyIDLen || !Token(id) {
		return fmt.Errorf("%w: key ID %q: use 1–%d characters from A–Z a–z 0–9 . _ -", ErrInvalidKey, id, MaxKeyIDLen)
	}
	return nil
}

// Token reports whether s is made of [A-Za-z0-9._-] only: the characters
// of key IDs.
func Token(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// Keyring is the set of keys one process knows. Verifiers accept a value
// signed with any of Keys; signers sign with Current. To rotate without
// downtime: add the new key to every process's Keys, then switch the
// signers' Current to it, then remove the old key.
type Keyring struct {
	// Keys, each with a distinct ID. Empty means no authentication, which
	// its user must ask for (the feed's Insecure).
	Keys []Key
	// Current is the ID of the key signers sign with. Default: the first
	// of Keys. Verifiers ignore it.
	Current string
}

// Validate checks every key, that no ID appears twice and that Current
// names one of them; its errors wrap ErrInvalidKey.
func (k Keyring) Validate() error {
	seen := make(map[string]bool, len(k.Keys))
	for _, key := range k.Keys {
		if err := key.Validate(); err != nil {
			return err
		}
		if seen[key.ID] {
			return fmt.Errorf("%w: key ID %q appears twice in the keyring", ErrInvalidKey, key.ID)
		}
		seen[key.ID] = true
	}
	if k.Current != "" && !seen[k.Current] {
		return fmt.Errorf("%w: Keyring.Current is %q, which is not among Keys; add the key or fix the ID", ErrInvalidKey, k.Current)
	}
	return nil
}

// Signer returns the key signers sign with: Current, or the first key;
// nil when the ring is empty.
func (k Keyring) Signer() *Key {
	for i := range k.Keys {
		if k.Keys[i].ID == k.Current || k.Current == "" {
			return &k.Keys[i]
		}
	}
	return nil
}

// Clone copies the secrets, so that the caller may wipe or reuse its
// slices.
func (k Keyring) Clone() Keyring {
	out := Keyring{Current: k.Current, Keys: make([]Key, len(k.Keys))}
	for i, key := range k.Keys {
		out.Keys[i] = Key{ID: key.ID, Secret: append([]byte(nil), key.Secret...)}
	}
	return out
}

// Scheme is the one way caughtup signs: HMAC-SHA256 under a key's secret
// of the scheme's domain and then the message. The domain names what is
// signed (and, for the feed, which feed), so that no value signed for one
// use verifies for another that shares the key.
type Scheme struct{ prefix string }

// NewScheme is the scheme of a domain given as parts ("caughtup/feed/v1",
// the feed's name): each part is followed by a NUL byte in the MAC input,
// so that no two domains share a prefix.
func NewScheme(domain ...string) Scheme {
	var b strings.Builder
	for _, p := range domain {
		b.WriteString(p)
		b.WriteByte(0)
	}
	return Scheme{prefix: b.String()}
}

// Sum returns the MAC of msg under secret. Safe for concurrent use: each
// call makes its own HMAC state (a few hundred nanoseconds).
func (s Scheme) Sum(secret, msg []byte) []byte {
	h := hmac.New(sha256.New, secret)
	h.Write([]byte(s.prefix))
	h.Write(msg)
	return h.Sum(nil)
}

// Verify reports, in constant time, whether mac is msg's MAC under secret.
func (s Scheme) Verify(secret, msg, mac []byte) bool {
	return hmac.Equal(s.Sum(secret, msg), mac)
}

// MACs returns the scheme's HMAC state for each of keys, reused from one
// call to the next: for one goroutine that signs or verifies many
// messages (a feed sender or subscriber).
func (s Scheme) MACs(keys []Key) *MACs {
	m := &MACs{prefix: []byte(s.prefix), byID: make(map[string]hash.Hash, len(keys))}
	for _, k := range keys {
		m.byID[k.ID] = hmac.New(sha256.New, k.Secret)
	}
	return m
}

// MACs computes one Scheme's MACs under a set of keys. It is not safe for
// concurrent use.
type MACs struct {
	prefix []byte
	byID   map[string]hash.Hash
	out    [Size]byte
}

// Sum returns the MAC of msg under key id (nil when the key is not
// known). The result is valid until the next call.
func (m *MACs) Sum(id string, msg []byte) []byte {
	h, ok := m.byID[id]
	if !ok {
		return nil
	}
	h.Reset()
	h.Write(m.prefix)
	h.Write(msg)
	return h.Sum(m.out[:0])
}

// Verify reports whether mac is msg's MAC under key id, in constant time;
// known is false when the key is not among the MACs' keys.
func (m *MACs) Verify(id string, msg, mac []byte) (ok, known bool) {
	want := m.Sum(id, msg)
	if want == nil {
		return false, false
	}
	return hmac.Equal(want, mac), true
}
