package position

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
)

func TestEncodeRoundTrip(t *testing.T) {
	t.Parallel()
	one := New("main", tl1, MustParseLSN("16/B374D848"), SourcePrimary, t0)
	s, err := one.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if len(s) > 96 {
		t.Errorf("one database encodes to %d bytes (%q), want <= 96", len(s), s)
	}
	// The longest one-database token still fits.
	worst := New(strings.Repeat("d", 20), Epoch{SystemID: ^uint64(0), Timeline: ^uint32(0)}, ^LSN(0), SourceReplica, t0)
	if ws, _ := worst.Encode(); len(ws) > 96 {
		t.Errorf("a 20-character database name with maximal numbers takes %d bytes", len(ws))
	}
	for _, tok := range []Token{
		one,
		Of(t0, Entry{Database: "main", Epoch: tl2, LSN: 0x10, Source: SourceReplica}, Entry{Database: "ci-db_2", Epoch: tl1, LSN: 0, Source: SourceCDC}),
		Of(t0, Entry{Database: "x", LSN: 1}), // unknown epoch survives
		New("main", tl1, 5, SourceUnknown, t0.Add(-t0.Sub(t0))),
	} {
		s, err := tok.Encode()
		if err != nil {
			t.Fatalf("Encode(%+v): %v", tok, err)
		}
		assertHeaderSafe(t, s)
		back, err := Decode(s)
		if err != nil {
			t.Fatalf("Decode(%q): %v", s, err)
		}
		if !reflect.DeepEqual(back.Entries, tok.Entries) || !back.CapturedAt.Equal(tok.CapturedAt) {
			t.Fatalf("round trip of %q:\n got %+v\nwant %+v", s, back, tok)
		}
	}
}

// assertHeaderSafe checks the value needs no escaping as an HTTP header
// (RFC 9110 field-value: visible ASCII), an asynq header or a Kafka header,
// and avoids characters that proxies treat as list or quote syntax.
func assertHeaderSafe(t *testing.T, s string) {
	t.Helper()
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`",\`, c) >= 0 {
			t.Fatalf("%q has header-unsafe byte %q at %d", s, c, i)
		}
	}
}

func TestEncodeRejectsInvalidTokens(t *testing.T) {
	t.Parallel()
	if s, err := (Token{}).Encode(); s != "" || err != nil {
		t.Errorf("empty token encodes to %q, %v; want no header", s, err)
	}
	bad := map[string]Token{
		"bad name":  New("bad name", tl1, 1, SourcePrimary, t0),
		"empty":     New("", tl1, 1, SourcePrimary, t0),
		"duplicate": {Entries: []Entry{{Database: "a", Epoch: tl1}, {Database: "a", Epoch: tl1}}},
	}
	many := Token{}
	for i := range MaxDatabases + 1 {
		many.Entries = append(many.Entries, Entry{Database: fmt.Sprintf("d%02d", i), Epoch: tl1})
	}
	bad["too many"] = many
	for name, tok := range bad {
		if _, err := tok.Encode(); err == nil {
			t.Errorf("%s: Encode accepted %+v", name, tok)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	t.Parallel()
	valid := "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.0/16B3740"
	if _, err := Decode(valid); err != nil {
		t.Fatalf("Decode(valid): %v", err)
	}
	tests := []struct {
		in   string
		want error
	}{
		{"", ErrMalformed},
		{"v2;0;main=p.1.1.0/1", ErrUnknownVersion},
		{"v99;0;main=p.1.1.0/1", ErrUnknownVersion},
		{"x1;0;main=p.1.1.0/1", ErrMalformed},
		{"v1", ErrMalformed},
		{"v1;", ErrMalformed},
		{"v1;0", ErrMalformed},
		{"v1;0;", ErrMalformed},
		{"v1;0;main", ErrMalformed},
		{"v1;0;main=", ErrMalformed},
		{"v1;0;main=x.1.1.0/1", ErrMalformed},
		{"v1;0;main=p1.1.0/1", ErrMalformed},
		{"v1;0;main=p.1.1", ErrMalformed},
		{"v1;0;main=p.1.1.", ErrMalformed},
		{"v1;0;main=p.1.1.0/", ErrMalformed},
		{"v1;0;main=p.1.1.0/1;", ErrMalformed},
		{"v1;0;main=p.1.1.0/1;;", ErrMalformed},
		{"v1;0;main=p.1.1.0/1 ", ErrMalformed},
		{"v1;0;main=p.1.1.0/g", ErrMalformed},
		{"v1;0;main=p.11111111111111111.1.0/1", ErrMalformed}, // 17 hex digits
		{"v1;0;main=p.1.100000000.0/1", ErrMalformed},         // timeline > 32 bits
		{"v1;0;main=p.1.1.100000000/1", ErrMalformed},         // LSN half > 32 bits
		{"v1;zzzzzzzzzzzzz;main=p.1.1.0/1", ErrMalformed},     // time overflow
		{"v1;0;ma\x00in=p.1.1.0/1", ErrMalformed},
		{"v1;0;m\nain=p.1.1.0/1", ErrMalformed},
		{"v1;0;mäin=p.1.1.0/1", ErrMalformed},
		{"v1;0;" + strings.Repeat("d", 64) + "=p.1.1.0/1", ErrMalformed},
		{"v1;0;main=p.1.1.0/1;main=r.1.1.0/2", ErrDuplicateDatabase},
		{"v1;0;b=p.1.1.0/1;a=p.1.1.0/1;b=p.1.1.0/1", ErrDuplicateDatabase},
		{"v1;0;" + strings.Repeat("a=p.1.1.0/1;", 100), ErrTooLarge},
		{tooManyDatabases(), ErrTooLarge},
	}
	for _, tt := range tests {
		_, err := Decode(tt.in)
		var de *DecodeError
		if !errors.Is(err, tt.want) || !errors.As(err, &de) {
			t.Errorf("Decode(%q) = %v; want %v", tt.in, err, tt.want)
		}
	}
}

func tooManyDatabases() string {
	s := "v1;0"
	for i := range MaxDatabases + 1 {
		s += fmt.Sprintf(";d%d=p.1.1.0/1", i)
	}
	return s
}

// A thousand malformed variants of valid tokens: truncations, bad hex,
// overflowing numbers, wrong versions, duplicates and control characters.
// Each must be rejected with a typed error and none may panic.
func TestDecodeThousandMalformed(t *testing.T) {
	t.Parallel()
	base := Of(t0, Entry{Database: "main", Epoch: tl2, LSN: MustParseLSN("16/B374D848"), Source: SourcePrimary},
		Entry{Database: "ci", Epoch: tl1, LSN: 0x3000, Source: SourceReplica})
	valid, _ := base.Encode()
	rng := rand.New(rand.NewPCG(7, 11))
	inputs := map[string]bool{}
	add := func(s string) {
		if _, err := Decode(s); err == nil {
			return // a mutation that happens to be a valid token is not malformed
		}
		inputs[s] = true
	}
	for i := range len(valid) {
		add(valid[:i]) // every truncation
	}
	mutators := []func(string) string{
		func(s string) string { // bad hex
			i := rng.IntN(len(s))
			return s[:i] + string("gGxz-+ "[rng.IntN(7)]) + s[i+1:]
		},
		func(s string) string { // overflowing numbers
			i := strings.LastIndexByte(s, '/') + 1
			return s[:i] + strings.Repeat("F", 9+rng.IntN(8))
		},
		func(s string) string { return strings.Replace(s, ".2.", "."+strings.Repeat("1", 9+rng.IntN(5))+".", 1) },
		func(s string) string { return "v" + fmt.Sprint(2+rng.IntN(500)) + s[2:] }, // wrong version
		func(s string) string { return s + ";main=r.1.1.0/1" },                     // duplicate database
		func(s string) string { // control characters
			i := rng.IntN(len(s) + 1)
			return s[:i] + string(rune(rng.IntN(32))) + s[i:]
		},
		func(s string) string { // non-ASCII
			i := rng.IntN(len(s) + 1)
			return s[:i] + "\u00e9" + s[i:]
		},
		func(s string) string { return s + ";" + strings.Repeat("x", rng.IntN(2000)) },
		func(s string) string { i := rng.IntN(len(s)); return s[:i] + s[i+1:] }, // deletion
		func(s string) string { // swapped separators
			return strings.Replace(s, string(";.=/"[rng.IntN(4)]), string(";.=/"[rng.IntN(4)]), 1+rng.IntN(3))
		},
	}
	for len(inputs) < 1000 {
		add(mutators[rng.IntN(len(mutators))](valid))
	}
	kinds := map[error]int{}
	for in := range inputs {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("Decode(%q) panicked: %v", in, r)
				}
			}()
			_, err := Decode(in)
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("Decode(%q) = %v, want *DecodeError", in, err)
			}
			kinds[de.Err]++
		}()
	}
	for _, want := range []error{ErrMalformed, ErrUnknownVersion, ErrTooLarge, ErrDuplicateDatabase} {
		if kinds[want] == 0 {
			t.Errorf("no input produced %v: %v", want, kinds)
		}
	}
}

func TestTokenJSON(t *testing.T) {
	t.Parallel()
	tok := New("main", tl1, MustParseLSN("0/16B3740"), SourcePrimary, t0)
	b, err := json.Marshal(struct {
		Entries any `json:"entries"`
	}{tok.Entries})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"entries":[{"database":"main","epoch":{"system_id":"7301234567890123456","timeline":1},"lsn":"0/16B3740","source":"primary"}]}`
	if string(b) != want {
		t.Errorf("JSON = %s\nwant   %s", b, want)
	}
	var back struct{ Entries []Entry }
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back.Entries, tok.Entries) {
		t.Errorf("JSON round trip: %+v, %v", back.Entries, err)
	}
}

func BenchmarkDecode(b *testing.B) {
	s, _ := New("main", tl1, MustParseLSN("16/B374D848"), SourcePrimary, t0).Encode()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Decode(s); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncode(b *testing.B) {
	tok := New("main", tl1, MustParseLSN("16/B374D848"), SourcePrimary, t0)
	buf := make([]byte, 0, 128)
	b.ReportAllocs()
	for b.Loop() {
		buf, _ = tok.AppendText(buf[:0])
	}
}
