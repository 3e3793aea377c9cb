package caughtuphttp

import (
	"net/http"
	"strings"
	"testing"
)

// FuzzCookieValue holds cookieValue to Request.Cookie: the same value
// found, or none, for any Cookie header lines ("\n" separates lines in
// the input).
func FuzzCookieValue(f *testing.F) {
	for _, lines := range []string{
		"",
		"caughtup=abc.def",
		"a=1; caughtup=abc.def; b=2",
		"caughtup=\"abc.def\"",
		"caughtup=\"\"",
		"caughtup=\"",
		"caughtup=a\\b; caughtup=second",
		"caughtup=a\"b; caughtup=next",
		"  caughtup  =  x.y  ;",
		"caughtup\t=x",
		";;; caughtup=x;;;",
		"other=1\ncaughtup=from-second-line",
		"caughtup=one\ncaughtup=two",
		"caughtup",
		"caughtup=",
		"caughtup=a b",
		"caughtup=é",
		"caughtup=x" + strings.Repeat(";", maxCookies),
		"caughtup=x" + strings.Repeat(";", maxCookies-1),
		"Caughtup=upper; caughtup=lower",
		"__Host-caughtup=x; caughtup=y",
	} {
		f.Add(lines)
	}
	f.Fuzz(func(t *testing.T, lines string) {
		h := http.Header{}
		if lines != "" {
			h["Cookie"] = strings.Split(lines, "\n")
		}
		for _, name := range []string{DefaultInsecureCookieName, DefaultCookieName} {
			got, ok := cookieValue(h, name)
			c, err := (&http.Request{Header: h}).Cookie(name)
			if want := err == nil; ok != want || (ok && got != c.Value) {
				t.Fatalf("%q in %q: cookieValue = %q, %v; Request.Cookie = %+v, %v", name, lines, got, ok, c, err)
			}
		}
	})
}
