package sign_test

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/sign"
)

func TestKeys(t *testing.T) {
	t.Parallel()
	a, err := sign.GenerateKey("2025-06")
	require.NoError(t, err)
	b, err := sign.GenerateKey("2025-07")
	require.NoError(t, err)
	require.NotEqual(t, a.Secret, b.Secret)
	keys, err := sign.ParseKeys(a.Export() + ", " + b.Export())
	require.NoError(t, err)
	require.Equal(t, []sign.Key{a, b}, keys)
	require.NotContains(t, a.String(), a.Export()[len(a.ID)+1:], "String redacts the secret")
	require.NotContains(t, fmt.Sprintf("%#v %v", a, a), a.Export()[len(a.ID)+1:], "%#v and %v redact the secret")

	for _, bad := range []string{"nocolon", "k:!!!", "k:" + "c2hvcnQ=", "{x}:" + a.Export()[len(a.ID)+1:]} {
		_, err := sign.ParseKeys(bad)
		require.ErrorIs(t, err, sign.ErrInvalidKey, bad)
	}
	_, err = sign.GenerateKey("a b")
	require.ErrorIs(t, err, sign.ErrInvalidKey)
	_, err = sign.GenerateKey(strings.Repeat("k", sign.MaxKeyIDLen+1))
	require.ErrorIs(t, err, sign.ErrInvalidKey)

	require.ErrorIs(t, sign.Keyring{Keys: []sign.Key{a, a}}.Validate(), sign.ErrInvalidKey, "duplicate ID")
	require.ErrorIs(t, sign.Keyring{Keys: []sign.Key{a}, Current: "nope"}.Validate(), sign.ErrInvalidKey, "unknown Current")
	require.ErrorIs(t, sign.Keyring{Keys: []sign.Key{{ID: "k", Secret: make([]byte, 16)}}}.Validate(), sign.ErrInvalidKey, "short secret")
	require.Equal(t, "2025-07", sign.Keyring{Keys: []sign.Key{a, b}, Current: "2025-07"}.Signer().ID)
	require.Equal(t, "2025-06", sign.Keyring{Keys: []sign.Key{a, b}}.Signer().ID)
	require.Nil(t, sign.Keyring{}.Signer())

	ring := sign.Keyring{Keys: []sign.Key{a}}
	c := ring.Clone()
	c.Keys[0].Secret[0] ^= 0xff
	require.NotEqual(t, a.Secret[0], c.Keys[0].Secret[0], "Clone copies the secrets")
}

// TestSchemeIsTheOneBothUsed pins the MAC inputs that the feed's messages
// and the web session values were signed with before they shared this
// package: a rolling upgrade must verify what the previous version signed.
func TestSchemeIsTheOneBothUsed(t *testing.T) {
	t.Parallel()
	secret := bytes.Repeat([]byte{7}, sign.MinSecretLen)
	msg := []byte("\x01payload")
	old := func(prefix string) []byte {
		h := hmac.New(sha256.New, secret)
		h.Write([]byte(prefix))
		h.Write(msg)
		return h.Sum(nil)
	}
	feedWas := old("caughtup/feed/v1\x00default\x00")
	webWas := old("caughtup/http/v1\x00")

	feedScheme := sign.NewScheme("caughtup/feed/v1", "default")
	webScheme := sign.NewScheme("caughtup/http/v1")
	require.Equal(t, feedWas, feedScheme.Sum(secret, msg))
	require.Equal(t, webWas, webScheme.Sum(secret, msg))
	require.True(t, webScheme.Verify(secret, msg, webWas))
	require.False(t, webScheme.Verify(secret, msg, feedWas), "a feed MAC is not a web MAC under the same key")
	require.False(t, sign.NewScheme("caughtup/feed/v1", "other").Verify(secret, msg, feedWas), "nor another feed's")

	k := sign.Key{ID: "k1", Secret: secret}
	macs := feedScheme.MACs([]sign.Key{k})
	require.Equal(t, feedWas, macs.Sum("k1", msg))
	require.Equal(t, feedWas, macs.Sum("k1", msg), "the state is reset between calls")
	ok, known := macs.Verify("k1", msg, feedWas)
	require.True(t, ok)
	require.True(t, known)
	ok, known = macs.Verify("k1", []byte("altered"), feedWas)
	require.False(t, ok)
	require.True(t, known)
	_, known = macs.Verify("k2", msg, feedWas)
	require.False(t, known)
	require.Nil(t, macs.Sum("k2", msg))
}

// Keys are kept as "id:base64secret" (Export), e.g. in a secret store,
// and read back with ParseKeys. Printing a key never shows its secret.
func Example() {
	k, _ := sign.GenerateKey("2026-12")
	keys, err := sign.ParseKeys(k.Export())
	fmt.Println(len(keys), err, strings.HasPrefix(k.Export(), "2026-12:"))
	fmt.Println(keys[0])

	s := sign.NewScheme("example/v1")
	mac := s.Sum(keys[0].Secret, []byte("hello"))
	fmt.Println(len(mac), s.Verify(k.Secret, []byte("hello"), mac), s.Verify(k.Secret, []byte("hullo"), mac))
	// Output:
	// 1 <nil> true
	// sign.Key{ID: 2026-12, Secret: [redacted]}
	// 32 true false
}
