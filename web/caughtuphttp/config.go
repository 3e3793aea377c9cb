package caughtuphttp

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/sign"
)

// Config configures a Middleware. The zero value of every field but Keys
// means its documented default; WithDefaults fills them in.
type Config struct {
	// Keys sign and verify session values (HMAC-SHA256). The first signs;
	// every one verifies, so a key is rotated without logging anyone out
	// of their read-your-writes: add the new key second on every process,
	// then move it first, then drop the old one once MaxAge has passed.
	// Each is a sign.Key ("id:base64secret" through sign.ParseKeys, or
	// sign.GenerateKey; `caughtup feed --generate-key` prints one), with a
	// secret of at least sign.MinSecretLen random bytes. Required.
	// Use keys of their own, not the position feed's: a value is signed
	// for this use only (the MAC input starts with its own domain), but a
	// key leaked from one place should not open the other.
	Keys []sign.Key

	// MaxAge is how long a session carries its token after its last write:
	// the cookie's Max-Age and the age, signed into the value, past which
	// the value is refused (ReasonExpired). Must exceed the router's
	// Tracker.MaxLagTime plus Tracker.StalenessBound.
	// Default: DefaultMaxAge (5m).
	// A request without a token reads any healthy replica; a replica
	// without a write older than MaxLagTime is no longer healthy, so once
	// a cookie expires no replica the router uses lacks its writes.
	MaxAge time.Duration

	// Policy routes every request: consume.Delayed waits up to the
	// router's WaitBudget for a replica that has replayed the session's
	// token, then reads the primary; consume.Sticky reads the primary at
	// once (GitLab's web sessions: stick to the primary until a replica
	// caught up); consume.Always reads the primary. A request is never
	// deferred: there is no queue to put it back on.
	// Default: consume.PolicyDefault, the router's DefaultPolicy (Delayed
	// unless configured otherwise).
	// One setting then governs every adapter in the process.
	Policy consume.Policy

	// MaxWait bounds the time a request spends in routing: the wait for a
	// replica (at most the router's WaitBudget) and, while the fallback
	// cap keeps it off the primary, the hold for a replica or the cap.
	// A request still held then is answered by Unavailable. Must exceed
	// the router's WaitBudget.
	// Default: DefaultMaxWait (2s).
	// A user waits a second or two for a page rather than see it fail;
	// the cap (consume.Config.PrimaryRate) is what protects the primary.
	MaxWait time.Duration

	// Cookie is the name of the cookie that carries the session's value.
	// Default: DefaultCookieName ("__Host-caughtup"), or
	// DefaultInsecureCookieName ("caughtup") when Insecure, Domain or a
	// Path other than "/" rule the __Host- prefix out.
	// The prefix makes browsers refuse the cookie unless it is Secure,
	// host-only and for the whole site: no subdomain can plant one.
	Cookie string
	// Path is the cookie's Path.
	// Default: "/".
	// The token concerns every page that reads the database.
	Path string
	// Domain is the cookie's Domain.
	// Default: "", host-only.
	Domain string
	// SameSite is the cookie's SameSite attribute.
	// Default: http.SameSiteLaxMode.
	// Sent on top-level navigation (the redirect after a POST, a link in
	// an email), not on cross-site subrequests.
	SameSite http.SameSite
	// Insecure leaves Secure off the cookie, for plain HTTP in
	// development. Cookies are always HttpOnly: no script needs the token.
	// Default: false (Secure).
	Insecure bool

	// Header, if set, is a request and response header that carries the
	// same signed value, for API clients without a cookie store: a client
	// sends back the last value it received. A request's header wins over
	// its cookie.
	// Default: "" (cookies only).
	Header string

	// Route names the request in the router's warnings
	// (consume.Job.Source "http <route>") and this package's.
	// Default: the request's Pattern (set when the middleware wraps a
	// handler registered on an http.ServeMux, not the mux itself), else
	// its method.
	// Either is bounded, unlike the URL path.
	Route func(*http.Request) string

	// Unavailable answers a request that could not be routed within
	// MaxWait (err is a *consume.DeferError or the context's error).
	// Default: 503 Service Unavailable with Retry-After.
	Unavailable func(w http.ResponseWriter, r *http.Request, err error)

	// MeterProvider records the caughtup.http.* instruments.
	// Default: otel.GetMeterProvider().
	// As the OpenTelemetry contrib instrumentations do.
	MeterProvider metric.MeterProvider
	// Logger logs, sampled, ignored session values, writes whose token
	// missed the response and requests answered unavailable.
	// Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock that issues and checks session values.
	// Default: time.Now.
	Now func() time.Time
}

// Defaults, exported so that documentation and callers can refer to them.
const (
	DefaultMaxAge             = 5 * time.Minute
	DefaultMaxWait            = 2 * time.Second
	DefaultCookieName         = "__Host-caughtup"
	DefaultInsecureCookieName = "caughtup"
)

// ErrInvalidConfig is wrapped by every error Validate and New return.
var ErrInvalidConfig = errors.New("caughtup/http: invalid config")

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.MaxAge == 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.Path == "" {
		c.Path = "/"
	}
	if c.Cookie == "" {
		c.Cookie = DefaultCookieName
		if c.Insecure || c.Domain != "" || c.Path != "/" {
			c.Cookie = DefaultInsecureCookieName
		}
	}
	if c.SameSite == 0 {
		c.SameSite = http.SameSiteLaxMode
	}
	if c.Route == nil {
		c.Route = defaultRoute
	}
	if c.Unavailable == nil {
		c.Unavailable = unavailable
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

func defaultRoute(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.Method
}

// Validate checks a config after WithDefaults on its own; New also checks
// it against the router (MaxAge, MaxWait).
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(c.Keys) == 0 {
		return bad("Keys is empty: give at least one sign.Key (sign.GenerateKey) to sign session values with")
	}
	if err := (sign.Keyring{Keys: c.Keys}).Validate(); err != nil {
		return bad("Keys: %w", err)
	}
	if !validToken(c.Cookie) {
		return bad("Cookie %q is not a valid cookie name", c.Cookie)
	}
	secure := !c.Insecure
	switch {
	case strings.HasPrefix(c.Cookie, "__Host-") && (!secure || c.Domain != "" || c.Path != "/"):
		return bad("Cookie %q has the __Host- prefix, which browsers accept only when Secure, without Domain and with Path \"/\"", c.Cookie)
	case strings.HasPrefix(c.Cookie, "__Secure-") && !secure:
		return bad("Cookie %q has the __Secure- prefix, which browsers accept only when Secure", c.Cookie)
	case c.SameSite == http.SameSiteNoneMode && !secure:
		return bad("SameSite None needs a Secure cookie; browsers drop it otherwise")
	case c.SameSite < http.SameSiteDefaultMode || c.SameSite > http.SameSiteNoneMode:
		return bad("SameSite %d is not an http.SameSite", c.SameSite)
	case c.Header != "" && !validToken(c.Header):
		return bad("Header %q is not a valid header name", c.Header)
	case c.MaxAge < time.Second:
		return bad("MaxAge %v must be at least a second (cookies count in seconds)", c.MaxAge)
	case c.MaxWait < 0:
		return bad("MaxWait %v must not be negative", c.MaxWait)
	case c.Policy > consume.Delayed:
		return bad("Policy %d is not a consume.Policy: use consume.Always, Sticky, Delayed or PolicyDefault", c.Policy)
	case c.Route == nil || c.Unavailable == nil || c.Now == nil:
		return bad("Route, Unavailable or Now is nil; call WithDefaults first")
	}
	return nil
}

// validateFor checks what depends on the router's config.
func (c Config) validateFor(rc consume.Config) error {
	if bound := rc.Tracker.MaxLagTime + rc.Tracker.StalenessBound; c.MaxAge <= bound {
		return fmt.Errorf("%w: MaxAge %v must exceed the router's Tracker.MaxLagTime + StalenessBound (%v): a cookie that expires sooner leaves its session reading replicas that may still lack its writes and count as healthy", ErrInvalidConfig, c.MaxAge, bound)
	}
	if rc.WaitBudget > 0 && c.MaxWait <= rc.WaitBudget {
		return fmt.Errorf("%w: MaxWait %v must exceed the router's WaitBudget %v, or a request would give up waiting before it may read the primary", ErrInvalidConfig, c.MaxWait, rc.WaitBudget)
	}
	return nil
}

// validToken reports whether s is an RFC 9110 token, what cookie and header
// names must be.
func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

// unavailable is the default Config.Unavailable.
func unavailable(w http.ResponseWriter, _ *http.Request, err error) {
	retry := time.Second
	var de *consume.DeferError
	if errors.As(err, &de) && de.Delay > retry {
		retry = de.Delay
	}
	w.Header().Set("Retry-After", fmt.Sprint(int((retry+time.Second-1)/time.Second)))
	http.Error(w, "the database is busy: try again shortly", http.StatusServiceUnavailable)
}
