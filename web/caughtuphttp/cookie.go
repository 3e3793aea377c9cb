package caughtuphttp

import (
	"net/http"
	"strings"
)

// maxCookies is net/http's default limit on the cookies of one request
// (GODEBUG httpcookiemaxnum): past it, Request.Cookie finds none.
const maxCookies = 3000

// cookieValue is Request.Cookie(name).Value, found without allocating:
// the value of the first cookie called name whose value is valid (its
// surrounding double quotes removed), as net/http reads the Cookie
// header lines, and none when a request carries more than maxCookies
// cookies (net/http's default limit; its GODEBUG setting is not read).
// A request carries the session's value on every request, and
// Request.Cookie builds a *Cookie for each cookie of that name. name must
// be a valid cookie name (Config.Validate). FuzzCookieValue holds it to
// Request.Cookie.
func cookieValue(h http.Header, name string) (string, bool) {
	lines := h["Cookie"]
	if len(lines) == 0 {
		return "", false
	}
	count := 0
	for _, line := range lines {
		count += strings.Count(line, ";") + 1
	}
	if count > maxCookies {
		return "", false
	}
	for _, line := range lines {
		line = trimHTTPSpace(line)
		var part string
		for len(line) > 0 {
			part, line, _ = strings.Cut(line, ";")
			part = trimHTTPSpace(part)
			if part == "" {
				continue
			}
			n, v, _ := strings.Cut(part, "=")
			if trimHTTPSpace(n) != name {
				continue
			}
			if len(v) > 1 && v[0] == '"' && v[len(v)-1] == '"' {
				v = v[1 : len(v)-1]
			}
			if validCookieValue(v) {
				return v, true
			}
		}
	}
	return "", false
}

// trimHTTPSpace is textproto.TrimString: s without leading and trailing
// ASCII spaces, tabs, CRs and LFs.
func trimHTTPSpace(s string) string {
	isSpace := func(b byte) bool { return b == ' ' || b == '\t' || b == '\n' || b == '\r' }
	for len(s) > 0 && isSpace(s[0]) {
		s = s[1:]
	}
	for len(s) > 0 && isSpace(s[len(s)-1]) {
		s = s[:len(s)-1]
	}
	return s
}

// validCookieValue reports whether every byte of v may appear in a cookie
// value, as net/http accepts them.
func validCookieValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if b := v[i]; b < 0x20 || b >= 0x7f || b == '"' || b == ';' || b == '\\' {
			return false
		}
	}
	return true
}
