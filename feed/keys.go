package feed

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

// Key is one shared secret that publishers sign with and subscribers
// verify with. Its ID travels in every message (it is not secret) so that
// a subscriber knows which of its keys to verify with.
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
	if err := checkKeyID(id, false); err != nil {
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
			return nil, fmt.Errorf("%w: a key is written \"id:base64secret\"; got one without ':' (id %q)", ErrInvalidConfig, redactID(part))
		}
		secret, err := decodeSecret(enc)
		if err != nil {
			return nil, fmt.Errorf("%w: key %q: the secret is not base64", ErrInvalidConfig, id)
		}
		k := Key{ID: id, Secret: secret}
		if err := k.validate(); err != nil {
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
func (k Key) String() string { return "feed.Key{ID: " + k.ID + ", Secret: [redacted]}" }

// GoString is String, for %#v.
func (k Key) GoString() string { return k.String() }

func (k Key) validate() error {
	if err := checkKeyID(k.ID, false); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if len(k.Secret) < MinSecretLen {
		return fmt.Errorf("%w: key %q has a %d-byte secret; use at least %d random bytes (GenerateKey)", ErrInvalidConfig, k.ID, len(k.Secret), MinSecretLen)
	}
	return nil
}

// Keyring is the set of keys one process knows. Subscribers accept a
// message signed with any of Keys; publishers sign with Current. To
// rotate without downtime: add the new key to every process's Keys, then
// switch the publishers' Current to it, then remove the old key.
type Keyring struct {
	// Keys, each with a distinct ID. Empty means no authentication, which
	// must be asked for with Insecure in the publisher's or subscriber's
	// config.
	Keys []Key
	// Current is the ID of the key publishers sign with. Default: the
	// first of Keys. Subscribers ignore it.
	Current string
}

// validate checks the keys; current returns the signing key (nil when
// the ring is empty).
func (k Keyring) validate() error {
	seen := make(map[string]bool, len(k.Keys))
	for _, key := range k.Keys {
		if err := key.validate(); err != nil {
			return err
		}
		if seen[key.ID] {
			return fmt.Errorf("%w: key ID %q appears twice in the keyring", ErrInvalidConfig, key.ID)
		}
		seen[key.ID] = true
	}
	if k.Current != "" && !seen[k.Current] {
		return fmt.Errorf("%w: Keyring.Current is %q, which is not among Keys; add the key or fix the ID", ErrInvalidConfig, k.Current)
	}
	return nil
}

func (k Keyring) current() *Key {
	for i := range k.Keys {
		if k.Keys[i].ID == k.Current || k.Current == "" {
			return &k.Keys[i]
		}
	}
	return nil
}

// clone copies the secrets so that the caller may wipe or reuse its
// slices.
func (k Keyring) clone() Keyring {
	out := Keyring{Current: k.Current, Keys: make([]Key, len(k.Keys))}
	for i, key := range k.Keys {
		out.Keys[i] = Key{ID: key.ID, Secret: append([]byte(nil), key.Secret...)}
	}
	return out
}

// macDomain starts every MAC input. With the feed name after it, a
// message signed for one feed does not verify on another that shares
// the key, and no other use of the key can produce a feed MAC.
const macDomain = "caughtup/feed/v1\x00"

// macs computes MACs for one feed. It is not safe for concurrent use:
// each publisher's sender and each subscriber's loop has its own.
type macs struct {
	prefix []byte
	byID   map[string]hash.Hash
	out    [macSize]byte
}

func newMACs(feed string, keys []Key) *macs {
	m := &macs{prefix: []byte(macDomain + feed + "\x00"), byID: make(map[string]hash.Hash, len(keys))}
	for _, k := range keys {
		m.byID[k.ID] = hmac.New(sha256.New, k.Secret)
	}
	return m
}

// sum returns the MAC of signed under key id (nil when the key is not
// known). The result is valid until the next call.
func (m *macs) sum(id string, signed []byte) []byte {
	h, ok := m.byID[id]
	if !ok {
		return nil
	}
	h.Reset()
	h.Write(m.prefix)
	h.Write(signed)
	return h.Sum(m.out[:0])
}

// verify reports whether mac is signed's MAC under key id, in constant
// time; known is false when the key is not in the ring.
func (m *macs) verify(id string, signed, mac []byte) (ok, known bool) {
	want := m.sum(id, signed)
	if want == nil {
		return false, false
	}
	return hmac.Equal(want, mac), true
}
