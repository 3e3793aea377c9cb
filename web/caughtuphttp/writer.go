package caughtuphttp

import (
	"bufio"
	"context"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// session is one request's token bookkeeping.
type session struct {
	m   *Middleware
	w   http.ResponseWriter // the one Handler got
	ctx context.Context     // the handler's, with the enqueue session
	in  carried
	// before is the enqueue session's token when the handler starts: what
	// the request was routed with, raised to what the replicas read had
	// replayed. Entries that differ later were raised by the handler's
	// writes.
	before position.Token
	// drop names the databases whose entry in the carried token belongs
	// to another cluster; the next value leaves them out.
	drop []string
	// committed: the token went out (or can no longer go out); sent is the
	// enqueue session's token at that moment.
	committed bool
	sent      position.Token
}

// foreign adds to drop the databases the router could not compare with
// this cluster at all (another system identifier, or an epoch merged
// unknown) that foreignEntries had not found before routing,
// and returns those. Entries incomparable for other reasons (a timeline
// past its switchpoint) are kept: they read the primary until the value
// expires, which is never stale, only slower.
func (s *session) foreign(d consume.Decision) (late []string) {
	for _, dd := range d.Databases {
		if dd.Outcome != consume.OutcomePrimaryEpoch || slices.Contains(s.drop, dd.Database) {
			continue
		}
		if _, carried := s.in.tok.Entry(dd.Database); !carried {
			continue
		}
		if dd.Incomparable == position.OtherSystem || dd.Incomparable == position.UnknownEpoch {
			late = append(late, dd.Database)
		}
	}
	s.drop = append(s.drop, late...)
	return late
}

// written returns the entries of after that differ from before's.
func written(before, after position.Token) position.Token {
	var out []position.Entry
	for _, e := range after.Entries {
		if b, ok := before.Entry(e.Database); !ok || b != e {
			out = append(out, e)
		}
	}
	if len(out) == 0 {
		return position.Token{}
	}
	return position.Token{Entries: out, CapturedAt: after.CapturedAt}
}

// commit puts the session's value on the response header, once, before
// the header is written.
func (s *session) commit() {
	if s.committed {
		return
	}
	s.committed = true
	s.sent, _ = enqueue.TokenFrom(s.ctx)
	wrote := written(s.before, s.sent)
	base := s.in.tok
	if s.drop != nil {
		base = without(base, s.drop)
	}
	switch {
	case !wrote.IsZero():
		s.issue(base.Merge(wrote))
	case s.drop != nil && !base.IsZero():
		s.issue(base)
	case s.drop != nil || (s.in.rejected != nil && s.in.fromCookie):
		// Clear what was ignored, so that the client's next requests read
		// replicas again instead of the primary until the cookie expires.
		s.setCookie("", -1)
	}
}

func (s *session) issue(tok position.Token) {
	// Issued now, not when the request started: MaxAge counts from the
	// last write, however long the handler ran before it.
	value, err := s.m.codec.seal(tok, s.m.cfg.Now(), s.m.cfg.MaxAge)
	if err != nil {
		// Only a token past position's limits (MaxDatabases) gets here.
		// The client keeps what it had, which still covers earlier writes.
		s.m.warnSeal.Do(func() {
			s.m.cfg.Logger.ErrorContext(s.ctx, "caughtup: the session's token cannot be carried; the client's next request may read a replica without this request's writes",
				slog.Any("error", errSeal), slog.Any("cause", err))
		})
		return
	}
	s.m.met.issued.Add(s.ctx, 1)
	s.setCookie(value, int(s.m.cfg.MaxAge/time.Second))
	if s.m.cfg.Header != "" {
		s.w.Header().Set(s.m.cfg.Header, value)
	}
}

// setCookie sets or clears the session cookie. The response is then one
// user's: it must not be kept by a shared cache, which would hand the
// cookie (the user's token, or its clearing) to whoever asks next.
func (s *session) setCookie(value string, maxAge int) {
	cfg := &s.m.cfg
	keepPrivate(s.w.Header())
	http.SetCookie(s.w, &http.Cookie{
		Name: cfg.Cookie, Value: value, Path: cfg.Path, Domain: cfg.Domain, MaxAge: maxAge,
		Secure: !cfg.Insecure, HttpOnly: true, SameSite: cfg.SameSite,
	})
}

// keepPrivate makes h's Cache-Control forbid shared caches to store the
// response: "private", the directive HTTP caching (RFC 9111 5.2.2.7) has
// for a response meant for one user. The user's own browser may still
// keep it, as it keeps the cookie. no-store would also keep it from the
// browser's cache, which the cookie does not ask for; a handler that set
// no-store, or private, keeps its value. public, and a private that names
// fields (shared caches may store the rest), give way to private; the
// other directives stay (max-age then applies to the browser's cache).
func keepPrivate(h http.Header) {
	var keep []string
	for _, line := range h.Values("Cache-Control") {
		for _, d := range directives(line) {
			name, _, qualified := strings.Cut(d, "=")
			switch strings.ToLower(strings.TrimSpace(name)) {
			case "no-store":
				return
			case "private":
				if !qualified {
					return
				}
				continue
			case "public":
				continue
			}
			keep = append(keep, d)
		}
	}
	h.Set("Cache-Control", strings.Join(append(keep, "private"), ", "))
}

// directives splits a Cache-Control value at the commas outside quoted
// strings (private="Set-Cookie, Authorization" is one directive).
func directives(v string) []string {
	var out []string
	quoted, escaped, start := false, false, 0
	add := func(end int) {
		if d := strings.TrimSpace(v[start:end]); d != "" {
			out = append(out, d)
		}
	}
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case escaped:
			escaped = false
		case quoted && c == '\\':
			escaped = true
		case c == '"':
			quoted = !quoted
		case c == ',' && !quoted:
			add(i)
			start = i + 1
		}
	}
	add(len(v))
	return out
}

// hijacked: the handler took the connection; nothing more reaches the
// client through the response, so every write counts as late.
func (s *session) hijacked() {
	if !s.committed {
		s.committed, s.sent = true, s.before
	}
}

// finish runs after the handler: it commits a response the handler never
// wrote to (net/http writes its header after the handler returns), and
// counts the writes that came after the header.
func (s *session) finish(ctx context.Context, route string) {
	if !s.committed {
		s.commit()
		return
	}
	after, _ := enqueue.TokenFrom(s.ctx)
	if late := written(s.sent, after); !late.IsZero() {
		s.m.met.late.Add(ctx, 1)
		s.m.warnLate.Do(func() {
			s.m.cfg.Logger.WarnContext(ctx, "caughtup: the handler wrote after the response header was sent; the client did not get that write's token, so its next request may read a replica without it: write before responding",
				slog.String("route", route), slog.String("token", late.String()))
		})
	}
}

// responseWriter commits the session's value before anything of the
// response goes out.
type responseWriter struct {
	http.ResponseWriter
	s *session
}

var (
	_ http.Flusher  = (*responseWriter)(nil)
	_ http.Hijacker = (*responseWriter)(nil)
)

func (w *responseWriter) WriteHeader(code int) {
	// Informational responses (103 Early Hints) go out without ending the
	// header; the final one carries the cookie. 101 is final.
	if code < 100 || code >= 200 || code == http.StatusSwitchingProtocols {
		w.s.commit()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *responseWriter) Write(b []byte) (int, error) {
	w.s.commit()
	return w.ResponseWriter.Write(b)
}

// Flush is http.Flusher's: a flush sends the header.
func (w *responseWriter) Flush() { _ = w.FlushError() }

// FlushError is what http.ResponseController.Flush calls.
func (w *responseWriter) FlushError() error {
	w.s.commit()
	return http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack hands the connection over; writes made before or after it
// cannot reach the client through a cookie.
func (w *responseWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err == nil {
		w.s.hijacked()
	}
	return conn, rw, err
}

// Unwrap lets http.ResponseController reach the ResponseWriter beneath.
func (w *responseWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
