package position

import (
	"errors"
	"reflect"
	"strings"
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

// sameAsReference fails t unless an answer of the decoder (got, err) is
// the reference decoder's (want, wantErr) to the byte: the same entries in
// the same order, the same capture time (time.Time's fields compared, not
// just the instant), nil entries where the reference has nil, and the
// same *DecodeError (offset, sentinel, detail and excerpt).
func sameAsReference(t testing.TB, what string, s []byte, got Token, err error, want Token, wantErr error) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%s(%q) = %#v, the reference decoder %#v", what, s, got, want)
	}
	if (err == nil) != (wantErr == nil) {
		t.Fatalf("%s(%q) error %v, the reference decoder's %v", what, s, err, wantErr)
	}
	if err == nil {
		return
	}
	de, ok := err.(*DecodeError)
	wantDE, wantOK := wantErr.(*DecodeError)
	if !ok || !wantOK || *de != *wantDE {
		t.Fatalf("%s(%q) error %#v, the reference decoder's %#v", what, s, err, wantErr)
	}
}

// FuzzDecodeReference checks Decode, and a fresh HeaderDecoder, against
// the decoder they replaced (decode_ref_test.go) on one input.
func FuzzDecodeReference(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := Decode(s)
		want, wantErr := refDecode(s)
		sameAsReference(t, "Decode", []byte(s), got, err, want, wantErr)
		var h HeaderDecoder
		var ref refHeaderDecoder
		got, err = h.Decode([]byte(s))
		want, wantErr = ref.Decode([]byte(s))
		sameAsReference(t, "HeaderDecoder.Decode", []byte(s), got, err, want, wantErr)
	})
}

// FuzzHeaderDecoderReference checks a HeaderDecoder against the one it
// replaced on a sequence of values (the input's lines), the way a
// consumer's worker decodes record after record: what either remembers of
// the values before must never change an answer. Every answer is checked
// against the reference Decode too (DecodeHeaders of the one value).
func FuzzHeaderDecoderReference(f *testing.F) {
	for _, s := range fuzzSequenceSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, seq string) {
		var h HeaderDecoder
		var ref refHeaderDecoder
		for n, v := range strings.Split(seq, "\n") {
			if n == 64 {
				break
			}
			got, err := h.Decode([]byte(v))
			want, wantErr := ref.Decode([]byte(v))
			sameAsReference(t, "HeaderDecoder.Decode", []byte(v), got, err, want, wantErr)
			if v != "" {
				want, wantErr = refDecode(v)
				sameAsReference(t, "HeaderDecoder.Decode", []byte(v), got, err, want, wantErr)
			}
		}
	})
}

// fuzzSeeds are single values: tokens as Encode writes them and the ways
// a value can go wrong at each of its fields.
var fuzzSeeds = []string{
	"v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.0/16B3740",
	"v1;0;a=r.1.2.0/0;b=c.ffffffffffffffff.ffffffff.FFFFFFFF/FFFFFFFF",
	"v1;0;main=u.0.0.0/1",
	"v2;0;main=p.1.1.0/1",
	"v01;0;main=p.1.1.0/1",
	"v0001;0;main=p.1.1.0/1",
	"v00001;0;main=p.1.1.0/1",
	"v1",
	"v1;",
	"v1;0",
	"v1;0;",
	"v1;;",
	"x1;0;main=p.1.1.0/1",
	"v1;2gosa7pa2gw;main=p.1.1.0/1",
	"v1;2gosa7pa2gx;main=p.1.1.0/1",
	"v1;zzzzzzzzzzzzz;main=p.1.1.0/1",
	"v1;0;main=p.1.1.0/1;main=p.1.1.0/2",
	"v1;0;b=p.1.1.0/1;a=p.1.1.0/2;c=r.2.3.4/5",
	"v1;0;main=p.1.1.0/1;",
	"v1;0;main=p.1.1.0/1;;",
	"v1;0;main",
	"v1;0;main=",
	"v1;0;main=x.1.1.0/1",
	"v1;0;main=p",
	"v1;0;main=p1.1.0/1",
	"v1;0;main=p.",
	"v1;0;main=p.1",
	"v1;0;main=p.1.",
	"v1;0;main=p.1.1",
	"v1;0;main=p.1.1.",
	"v1;0;main=p.1.1.0",
	"v1;0;main=p.1.1.0/",
	"v1;0;main=p.1.1.0/1x",
	"v1;0;main=p.11111111111111111.1.0/1",
	"v1;0;main=p.1.111111111.0/1",
	"v1;0;main=p.1.1.111111111/1",
	"v1;0;main=p.1.1.1/111111111",
	"v1;0;main=p.1.1.1/1/1",
	"v1;0;=p.1.1.0/1",
	"v1;0;" + strings.Repeat("n", 64) + "=p.1.1.0/1",
	"v1;0;main=p.1.1.0/1\x00\n\"evil\"",
	"",
}

// fuzzSequenceSeeds are sequences of values, one a line, that exercise
// what a HeaderDecoder remembers: repeated values, heads repeated with new
// positions and capture times, heads that change by one byte, entries
// that move, failures between.
func fuzzSequenceSeeds() []string {
	a := "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.16/B374D848"
	b := "v1;mi3v0q2l;main=p.6f1e2d3c4b5a6978.1.16/B374D849"
	c := "v1;mi3v0q2l;main=p.6f1e2d3c4b5a6978.2.16/B374D849"
	two := "v1;mi3v0q2l;billing=c.abc.1.0/50;main=p.6f1e2d3c4b5a6978.1.16/B374D849"
	swapped := "v1;mi3v0q2l;main=p.6f1e2d3c4b5a6978.1.16/B374D849;billing=c.abc.1.0/50"
	lines := func(vs ...string) string { return strings.Join(vs, "\n") }
	return []string{
		lines(a, a, b, b, c, a),
		lines(a, two, swapped, two, a),
		lines(a, "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.", a, "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1"),
		lines(a, "", a, "garbage", a, "v2;0;main=p.1.1.0/1", a),
		lines(a, "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.10.16/B374D848", "v1;mi3v0q2k;mainx=p.6f1e2d3c4b5a6978.1.16/B374D848"),
		lines(two, "v1;mi3v0q2l;billing=c.abc.1.0/50;billing=p.6f1e2d3c4b5a6978.1.16/B374D849", two),
		lines("v1;0;main=p.1.1.0/1", "v01;0;main=p.1.1.0/1", "v1;00;main=p.1.1.0/1", "v1;0;main=p.1.1.0/1;"),
		lines(a, "garbage", "garbage", a, a, "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.16/B374D84", "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.16/B374D84"),
		lines("v1;0;a=p.1.1.0/1", "v1;0;a=p.1.1.0/1;b=r.2.2.0/2;c=c.3.3.0/3", "v1;0;b=p.1.1.0/1", "v1;0;c=c.3.3.0/3;a=p.1.1.0/1;b=r.2.2.0/2", "v1;0;a=p.1.1.0/1;b=r.2.2.0/2;c=c.3.3.0/3"),
	}
}
