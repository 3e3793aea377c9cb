package caughtuphttp_test

import (
	"fmt"
	"net/http"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/web/caughtuphttp"
)

// The cookie a session gets by default, and in development over plain
// HTTP.
func ExampleConfig_WithDefaults() {
	key, err := feed.GenerateKey("2026-12") // in production: feed.ParseKeys of a secret
	if err != nil {
		panic(err)
	}
	cfg := caughtuphttp.Config{Keys: []feed.Key{key}}.WithDefaults()
	fmt.Println(cfg.Cookie, cfg.MaxAge, cfg.Path, cfg.SameSite == http.SameSiteLaxMode, !cfg.Insecure)

	dev := caughtuphttp.Config{Keys: []feed.Key{key}, Insecure: true}.WithDefaults()
	fmt.Println(dev.Cookie, dev.Validate())
	// Output:
	// __Host-caughtup 5m0s / true true
	// caughtup <nil>
}
