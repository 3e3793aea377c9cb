package caughtuphttp

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCacheControl: a response that sets or clears the session cookie is
// private, whatever the handler set short of that; a stricter value the
// handler set stays; a response that does neither is left alone.
func TestCacheControl(t *testing.T) {
	e := setup(t, mods{})
	cases := []struct {
		set  []string // the handler's Cache-Control lines
		want string
	}{
		{nil, "private"},
		{[]string{"public, max-age=60"}, "max-age=60, private"},
		{[]string{"max-age=60", "PUBLIC"}, "max-age=60, private"},
		{[]string{"no-cache"}, "no-cache, private"},
		{[]string{`private="Set-Cookie, Caughtup-Session", max-age=5`}, "max-age=5, private"},
		{[]string{"no-store"}, "no-store"},
		{[]string{"private, max-age=5"}, "private, max-age=5"},
		{[]string{"max-age=0, No-Store"}, "max-age=0, No-Store"},
	}
	path := func(set []string) string {
		q := ""
		for _, v := range set {
			q += "&cc=" + url.QueryEscape(v)
		}
		return "/cached?x=1" + q
	}
	for _, tc := range cases {
		// Sets the cookie: the request wrote.
		resp, body := e.do(t, e.client(t), e.request(t, http.MethodPost, path(tc.set), ""))
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		require.NotNil(t, e.cookie(resp))
		require.Equal(t, tc.want, strings.Join(resp.Header.Values("Cache-Control"), ", "), "%q", tc.set)
		// Clears the cookie: the request's value was rejected.
		resp, body = e.do(t, e.client(t), e.request(t, http.MethodGet, path(tc.set), "not-a-value"))
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		require.NotNil(t, e.cookie(resp))
		require.Equal(t, tc.want, strings.Join(resp.Header.Values("Cache-Control"), ", "), "%q", tc.set)
	}
	// Neither: the handler's header as it was.
	resp, _ := e.do(t, e.client(t), e.request(t, http.MethodGet, path([]string{"public, max-age=60"}), ""))
	require.Nil(t, e.cookie(resp))
	require.Equal(t, "public, max-age=60", resp.Header.Get("Cache-Control"))
	resp, _ = e.do(t, e.client(t), e.request(t, http.MethodGet, path(nil), ""))
	require.Empty(t, resp.Header.Values("Cache-Control"))
}

func TestDirectives(t *testing.T) {
	t.Parallel()
	for in, want := range map[string][]string{
		"":                           nil,
		" , ,":                       nil,
		"a, b=1":                     {"a", "b=1"},
		`private="x, y", max-age=1`:  {`private="x, y"`, "max-age=1"},
		`a="q\"uo,te", b`:            {`a="q\"uo,te"`, "b"},
		`a="unterminated, b`:         {`a="unterminated, b`},
		"no-store,no-cache,max-age=": {"no-store", "no-cache", "max-age="},
	} {
		require.Equal(t, want, directives(in), "%q", in)
	}
}
