package caughtuphttp

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{Keys: []feed.Key{testKey(t, "k")}}.WithDefaults()
	require.NoError(t, c.Validate())
	require.Equal(t, DefaultCookieName, c.Cookie)
	require.Equal(t, DefaultMaxAge, c.MaxAge)
	require.Equal(t, DefaultMaxWait, c.MaxWait)
	require.Equal(t, http.SameSiteLaxMode, c.SameSite)
	require.Equal(t, "/", c.Path)
	for _, mod := range []func(*Config){
		func(c *Config) { c.Insecure = true },
		func(c *Config) { c.Domain = "example.com" },
		func(c *Config) { c.Path = "/app" },
	} {
		c := Config{Keys: []feed.Key{testKey(t, "k")}}
		mod(&c)
		c = c.WithDefaults()
		require.Equal(t, DefaultInsecureCookieName, c.Cookie, "the __Host- prefix needs Secure, no Domain and Path /")
		require.NoError(t, c.Validate())
	}
}

func TestConfigInvalid(t *testing.T) {
	t.Parallel()
	k := testKey(t, "k")
	for name, c := range map[string]Config{
		"no keys":          {},
		"short secret":     {Keys: []feed.Key{{ID: "k", Secret: make([]byte, 16)}}},
		"bad key ID":       {Keys: []feed.Key{{ID: "a b", Secret: k.Secret}}},
		"duplicate ID":     {Keys: []feed.Key{k, k}},
		"__Host- insecure": {Keys: []feed.Key{k}, Cookie: "__Host-x", Insecure: true},
		"__Secure- plain":  {Keys: []feed.Key{k}, Cookie: "__Secure-x", Insecure: true},
		"None insecure":    {Keys: []feed.Key{k}, SameSite: http.SameSiteNoneMode, Insecure: true},
		"bad cookie name":  {Keys: []feed.Key{k}, Cookie: "a;b"},
		"bad header":       {Keys: []feed.Key{k}, Header: "a b"},
		"tiny max age":     {Keys: []feed.Key{k}, MaxAge: time.Millisecond},
		"bad policy":       {Keys: []feed.Key{k}, Policy: consume.Delayed + 1},
		"negative wait":    {Keys: []feed.Key{k}, MaxWait: -time.Second},
	} {
		err := c.WithDefaults().Validate()
		require.Error(t, err, name)
		require.True(t, errors.Is(err, ErrInvalidConfig), "%s: %v", name, err)
	}
}

// TestConfigAgainstRouter: MaxAge must outlive what the router still
// counts as a healthy replica, MaxWait the router's wait.
func TestConfigAgainstRouter(t *testing.T) {
	t.Parallel()
	rc := consume.Config{Tracker: replay.TrackerConfig{}}.WithDefaults()
	c := Config{Keys: []feed.Key{testKey(t, "k")}}.WithDefaults()
	require.NoError(t, c.validateFor(rc))
	c.MaxAge = rc.Tracker.MaxLagTime
	require.ErrorIs(t, c.validateFor(rc), ErrInvalidConfig)
	c.MaxAge = DefaultMaxAge
	c.MaxWait = rc.WaitBudget
	require.ErrorIs(t, c.validateFor(rc), ErrInvalidConfig)
	rc.WaitBudget = -1 // waiting disabled: any MaxWait
	require.NoError(t, c.validateFor(rc))
	_, err := New(nil, c)
	require.ErrorIs(t, err, ErrInvalidConfig)
}
