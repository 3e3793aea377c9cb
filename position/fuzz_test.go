package position

import (
	"errors"
	"reflect"
	"testing"
)

// FuzzDecode checks that Decode never panics, that every rejection is a
// typed *DecodeError, that whatever it accepts re-encodes to a token
// that decodes to the same value, and that a HeaderDecoder (one that has
// decoded every input before, and a fresh one) answers as Decode does.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		"v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.0/16B3740",
		"v1;0;a=r.1.2.0/0;b=c.ffffffffffffffff.ffffffff.FFFFFFFF/FFFFFFFF",
		"v1;0;main=u.0.0.0/1",
		"v2;0;main=p.1.1.0/1",
		"v1;0;main=p.1.1.0/1;main=p.1.1.0/2",
		"",
		"v1;;",
	} {
		f.Add(s)
	}
	var h HeaderDecoder
	f.Fuzz(func(t *testing.T, s string) {
		sameDecoding(t, &h, s)
		sameDecoding(t, &HeaderDecoder{}, s)
		tok, err := Decode(s)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) || de.Err == nil {
				t.Fatalf("Decode(%q) = %v, want *DecodeError", s, err)
			}
			return
		}
		enc, err := tok.Encode()
		if err != nil {
			t.Fatalf("Decode(%q) accepted a token that does not encode: %v", s, err)
		}
		back, err := Decode(enc)
		if err != nil {
			t.Fatalf("re-encoded %q -> %q does not decode: %v", s, enc, err)
		}
		if !reflect.DeepEqual(back.Entries, tok.Entries) || !back.CapturedAt.Equal(tok.CapturedAt) {
			t.Fatalf("%q -> %q changed the token: %+v vs %+v", s, enc, tok, back)
		}
	})
}

// FuzzParseLSN checks ParseLSN against its own printer.
func FuzzParseLSN(f *testing.F) {
	for _, s := range []string{"0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF", "1/2/3", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		l, err := ParseLSN(s)
		if err != nil {
			return
		}
		if back, err := ParseLSN(l.String()); err != nil || back != l {
			t.Fatalf("%q -> %v -> %v, %v", s, l, back, err)
		}
	})
}
