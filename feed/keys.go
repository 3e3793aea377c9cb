package feed

import (
	"fmt"

	"github.com/caughtup/caughtup/sign"
)

// The feed's keys are package sign's: one signing scheme for the feed and
// web sessions. These names stay so that feed configurations read as
// before.

// MinSecretLen is sign.MinSecretLen.
const MinSecretLen = sign.MinSecretLen

// Key is a sign.Key: one shared secret that publishers sign with and
// subscribers verify with; its ID travels in every message.
type Key = sign.Key

// Keyring is a sign.Keyring: subscribers accept a message signed with any
// of Keys; publishers sign with Current (the first key by default).
type Keyring = sign.Keyring

// GenerateKey is sign.GenerateKey, with errors that wrap ErrInvalidConfig.
func GenerateKey(id string) (Key, error) {
	k, err := sign.GenerateKey(id)
	if err != nil {
		return Key{}, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return k, nil
}

// ParseKeys is sign.ParseKeys, with errors that wrap ErrInvalidConfig.
func ParseKeys(text string) ([]Key, error) {
	keys, err := sign.ParseKeys(text)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return keys, nil
}

// macDomain names what a feed MAC signs: with the feed name after it, a
// message signed for one feed does not verify on another that shares the
// key, and no other use of the key (a web session value) can produce a
// feed MAC.
const macDomain = "caughtup/feed/v1"

// newMACs is the reusable MAC state of one feed's sender or subscriber
// loop (not safe for concurrent use).
func newMACs(feed string, keys []Key) *sign.MACs {
	return sign.NewScheme(macDomain, feed).MACs(keys)
}

// checkKeys is Keyring.Validate, with errors that wrap ErrInvalidConfig.
func checkKeys(k Keyring) error {
	if err := k.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return nil
}
